#!/usr/bin/env python3
"""Allocated and reserved memory against time within training steps, from CUDA memory snapshots.

    python scripts/plot_timeline.py SNAP_A.pickle [SNAP_B.pickle ...] --out timeline.png \\
        [--step 8] [--steps 2]

Each snapshot is one pipeline's run (``bench_pipeline.py --snapshot DIR`` writes
``DIR/<pipeline>-rank0.pickle``, with the steps tagged ``step k``). For each, the plot shows
``--steps`` steps from the start of step ``--step`` (time 0 = the step's first allocator
event): the allocated bytes (solid) and the reserved bytes (dashed), so that a reader sees when
each batch's tensors are made and given back, and where the peak falls. Reads the pickle only
(no torch): runs on any machine.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from recpipe.bench.memory_snapshot import (
    _SEGMENT_GROW,
    _SEGMENT_SHRINK,
    load,
    pick_device,
    segments_of,
    trace_of,
)

_ALLOC, _FREE = ("alloc",), ("free_requested",)  # "allocated" memory, as memory_snapshot counts it


def curves(snapshot: Mapping[str, Any], step: int, steps: int) -> tuple[list[float], list[float], list[float]]:
    """(time ms from the start of ``step``, allocated MiB, reserved MiB) over ``steps`` steps.

    The totals at the trace's start are the final state (the snapshot's segments) minus every
    change in the trace, so a trace that is a ring buffer still gives absolute numbers."""
    device = pick_device(snapshot)
    trace = trace_of(snapshot, device)
    segments = segments_of(snapshot, device)
    final_res = sum(int(s["total_size"]) for s in segments)
    final_alloc = sum(int(b["size"]) for s in segments for b in s.get("blocks", ())
                      if b.get("state") == "active_allocated")
    d_alloc = [_delta(e, _ALLOC, _FREE) for e in trace]
    d_res = [_delta(e, _SEGMENT_GROW, _SEGMENT_SHRINK) for e in trace]
    alloc, res = final_alloc - sum(d_alloc), final_res - sum(d_res)
    first = _first(trace, f"step {step}")
    last = _first(trace, f"step {step + steps}", default=len(trace))
    if first is None:
        raise SystemExit(f"no allocation tagged 'step {step}' in the trace: pick another --step")
    t0 = trace[first].get("time_us", 0)
    ts, xs, ys = [], [], []
    for i, e in enumerate(trace[:last]):
        alloc += d_alloc[i]
        res += d_res[i]
        if i >= first:
            ts.append((e.get("time_us", 0) - t0) / 1e3)
            xs.append(alloc / 2**20)
            ys.append(res / 2**20)
    return ts, xs, ys


def _delta(e: Mapping[str, Any], grow: tuple[str, ...], shrink: tuple[str, ...]) -> int:
    action = e.get("action")
    size = int(e.get("size", 0))
    return size if action in grow else -size if action in shrink else 0


def _first(trace: Sequence[Mapping[str, Any]], tag: str, default: int | None = None) -> int | None:
    return next((i for i, e in enumerate(trace) if e.get("user_metadata") == tag), default)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("snapshots", nargs="+", help="CUDA memory snapshots (bench_pipeline.py --snapshot)")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--step", type=int, default=8, help="first step shown (0-based)")
    p.add_argument("--steps", type=int, default=2, help="steps shown")
    p.add_argument("--title", default="", help="the plot's title")
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for color, path in zip(plt.get_cmap("tab10").colors, a.snapshots):
        name = os.path.basename(path).removesuffix(".pickle").removesuffix("-rank0")
        ts, alloc, res = curves(load(path), a.step, a.steps)
        ax.plot(ts, alloc, color=color, lw=1, label=f"{name} allocated (peak {max(alloc):.0f} MiB)")
        ax.plot(ts, res, color=color, lw=1, ls="--", label=f"{name} reserved (peak {max(res):.0f} MiB)")
    ax.set_xlabel(f"ms from the start of step {a.step} ({a.steps} steps)")
    ax.set_ylabel("MiB")
    ax.set_title(a.title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
