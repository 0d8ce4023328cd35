"""Recording CUDA memory snapshots of pipeline runs (on the GPU machine; torch's
``torch.cuda.memory._record_memory_history`` with Python stacks, ``_dump_snapshot`` after a
chosen step). What is live at their peak: :mod:`recpipe.bench.memory_snapshot` (any machine).

- :func:`start_recording`, :func:`mark_step`, :func:`dump`, :func:`stop_recording`;
- :class:`SnapshotProfiler`: the same behind the ``start() / step() / stop()`` interface that
  ``scripts/bench_pipeline.py``'s ``run_once(..., prof=...)`` drives (``--snapshot DIR``);
- :func:`pipeline_stream_names`: ``{cudaStream_t: "main" | "data_dist" | "memcpy" | ...}`` of a
  pipeline, written next to the pickle (``<pickle>.streams.json``); without it, stream names
  are guessed from the stacks that allocate on each stream.

torch is imported inside the functions: the module loads anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from recpipe.bench.memory_snapshot import full_report, load

def start_recording(
    max_entries: int = 200_000, stacks: Literal["python", "all"] = "python"
) -> bool:
    """Record every allocator event with its Python stack (``stacks="all"``: C++ frames too).

    ``max_entries`` bounds the trace (a ring buffer: the newest events are kept); at a few KB
    per entry, 200k entries cover some 50 steps of the large config. Returns False (and does
    nothing) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks=stacks, max_entries=max_entries
    )
    return True


def stop_recording() -> None:
    """Stop recording (the recorded history is dropped with it)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)


def mark_step(step: int | str) -> None:
    """Tag the allocations made from now on with ``"step <step>"`` (shown in the tables'
    ``steps`` column), where this torch has ``_set_memory_metadata``; else a no-op."""
    import torch

    setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
    if setter is not None and torch.cuda.is_available():
        try:
            setter(f"step {step}")
        except (AttributeError, RuntimeError):  # wrapper present, binding missing
            pass


def pipeline_stream_names(pipeline: Any) -> dict[int, str]:
    """``{cudaStream_t as int: name}`` for a torchrec/recpipe ``TrainPipelineSparseDist``: the
    current stream (main; call from the thread that runs ``progress()``), ``data_dist``,
    ``memcpy`` and recpipe's side stream where it has one."""
    import torch

    names: dict[int, str] = {}
    device = getattr(pipeline, "_device", None)
    if device is None or getattr(device, "type", None) != "cuda":
        return names
    names[int(torch.cuda.current_stream(device).cuda_stream)] = "main"
    for attr, name in (("_data_dist_stream", "data_dist"), ("_memcpy_stream", "memcpy"),
                       ("_side", "recpipe_side"), ("_prefetch_stream", "prefetch")):
        stream = getattr(pipeline, attr, None)
        if stream is not None and hasattr(stream, "cuda_stream"):
            names[int(stream.cuda_stream)] = name
    return names


def dump(
    path: str,
    stream_names: Mapping[int, str] | None = None,
    summary: bool = True,
    top: int = 25,
) -> str:
    """``torch.cuda.memory._dump_snapshot(path)``; stream names (if given) go to
    ``<path>.streams.json``; with ``summary``, the markdown report (:func:`report`, every
    moment kind and per stream) to ``<path>.md``, so that the small text can come back from
    the GPU machine without the pickle. Returns ``path``."""
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
    if stream_names:
        with open(path + ".streams.json", "w") as f:
            json.dump({str(k): v for k, v in stream_names.items()}, f)
    if summary:
        snapshot = load(path)
        with open(path + ".md", "w") as f:
            f.write(full_report(snapshot, top=top))
    return path


class SnapshotProfiler:
    """A stand-in for ``bench_pipeline.run_once``'s ``prof`` argument (it calls ``start()``
    before the first step, ``step()`` after each, ``stop()`` after the last): records from
    ``start()``, tags each step's allocations (:func:`mark_step`: ``step k`` = during the
    k-th ``progress()`` call, 0-based) and dumps after ``dump_after`` steps (None: at
    ``stop()``, i.e. after the last step). ``stream_names``: a mapping, or a callable giving
    one at dump time (e.g. ``lambda: pipeline_stream_names(pipeline)``)."""

    def __init__(
        self,
        path: str,
        dump_after: int | None = None,
        max_entries: int = 200_000,
        stacks: Literal["python", "all"] = "python",
        stream_names: Mapping[int, str] | Any = None,
        summary: bool = True,
        top: int = 25,
    ) -> None:
        self.path = path
        self.dump_after = dump_after
        self.max_entries = max_entries
        self.stacks = stacks
        self.stream_names = stream_names
        self.summary = summary
        self.top = top
        self.steps = 0
        self.dumped: str | None = None
        self._recording = False

    def start(self) -> None:
        self._recording = start_recording(self.max_entries, self.stacks)
        if self._recording:
            mark_step(0)

    def step(self) -> None:
        self.steps += 1
        if not self._recording:
            return
        if self.dump_after is not None and self.steps == self.dump_after and not self.dumped:
            self._dump()
        mark_step(self.steps)

    def stop(self) -> None:
        if self._recording:
            if not self.dumped:
                self._dump()
            stop_recording()
            self._recording = False

    def _dump(self) -> None:
        names = self.stream_names() if callable(self.stream_names) else self.stream_names
        self.dumped = dump(self.path, names, summary=self.summary, top=self.top)
