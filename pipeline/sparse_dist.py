"""``TrainPipelineSparseDist`` with the KJT permutes written into memory that is reusable on time.

A drop-in subclass of torchrec's pipeline: same constructor, same ``progress()``. It changes only
where the two permutes of the sparse input distribution write (shared/DESIGN.md):

- P1, the feature-order permute in ``input_dist`` (on the data_dist stream): into a
  pipeline-owned :class:`~recpipe.pipeline.buffers.BufferRing`, one slot per batch in flight.
- P2, the recat permute in ``dist_init`` (world size > 1, data_dist stream, inside the
  pipelined forward): into buffers allocated on the main stream
  (:func:`~recpipe.pipeline.buffers.main_stream_allocator`).

Neither needs ``record_stream`` (torchrec still calls it on the KJT; for main-stream memory it is
a no-op, and ring memory is never freed while in use). Everything else is torchrec's code path,
so the losses are bit-identical: recpipe's permute gives fbgemm's results exactly.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSparseDist as _TorchrecTrainPipelineSparseDist,
)
from torchrec.distributed.types import Awaitable

from recpipe.kjt import PermuteInto
from recpipe.pipeline.buffers import BufferRing, main_stream_allocator
from recpipe.pipeline.compat import (
    clears_data_dist_inputs,
    dist_init_on_main_stream,
    keep_output_dist_request,
)


class RecpipePipelinedForward(PipelinedForward):
    """torchrec's ``PipelinedForward`` (same steps, same record_stream calls), except that

    - the input-dist wait (``dist_init``: the recat permute, on data_dist) writes its permutes
      into main-stream memory (:func:`~recpipe.pipeline.buffers.main_stream_allocator`);
    - main waits on an *event* for this batch's input dist instead of on the whole data_dist
      stream: with one rank, the event recorded when the batch's input dist was done (a step
      earlier), so that main never waits for the next batch's input dist, which waits for the
      ring slot (see ``TrainPipelineSparseDist.ring_depth``); with several ranks, an event
      after ``dist_init`` (which data_dist runs after the next batch's input dist anyway).

    Class attributes set per pipeline: ``counts`` (redirected permutes), ``input_dist_done``
    (batch index -> event on data_dist), ``world_size``.
    """

    counts: Counter
    input_dist_done: dict[int, torch.cuda.Event]
    world_size: int

    def __call__(self, *input: Any, **kwargs: Any) -> Awaitable:
        if self._name not in self._context.input_dist_tensors_requests:
            return super().__call__(*input, **kwargs)  # torchrec's error
        request = self._context.input_dist_tensors_requests.pop(self._name)
        on_main = dist_init_on_main_stream() or self._stream is None
        main = torch.cuda.current_stream(self._stream.device) if self._stream else None
        mode = PermuteInto(main_stream_allocator(None if on_main else main))
        with record_function("## wait_sparse_data_dist ##"):
            with nullcontext() if on_main else torch.cuda.stream(self._stream), mode:
                data = request.wait()
        self.counts["dist_init"] += mode.calls
        ctx = self._context.module_contexts.pop(self._name)
        if self._stream is not None:
            done = self.input_dist_done.get(self._context.index)
            if self.world_size > 1 or done is None:
                done = torch.cuda.Event()
                done.record(self._stream)
            main.wait_event(done)
            data.record_stream(main)
            ctx.record_stream(main)
        awaitable = self._module.compute_and_output_dist(ctx, data)
        keep_output_dist_request(self._context, self._name, awaitable)
        return awaitable


class TrainPipelineSparseDist(_TorchrecTrainPipelineSparseDist):
    """torchrec's ``TrainPipelineSparseDist``, with the sparse permutes' outputs in memory that
    the allocator can reuse on time (see the module docstring). Same arguments and behaviour.
    """

    #: P1 ring slots, one per batch in flight; None: 2 with one rank, 3 with several.
    #: The slot of batch i+1 is the one batch i+1-depth used, so data_dist's input dist of batch
    #: i+1 waits for main to finish that batch's step. With one rank, main waits only on batch
    #: i's own input-dist event (see RecpipePipelinedForward), so depth 2 costs no time. With
    #: several ranks, data_dist runs batch i's dist_init after batch i+1's input dist, and main
    #: waits for it: depth 2 would put step i-1 -> input dist i+1 -> dist_init i -> forward i in
    #: series, so depth 3 (a wait two steps old, free).
    #: Measured on 1 H100, large config, before the per-batch event: depth 2 38.7 ms/iter (peak
    #: reserved -2840 MiB), depth 3 31.6 ms/iter, torchrec 31.7 ms/iter.
    ring_depth: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        main = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        world = dist.get_world_size() if dist.is_initialized() else 1
        depth = self.ring_depth or (2 if world == 1 else 3)
        self._ring = BufferRing(main, depth)
        self._use_ring = not clears_data_dist_inputs(self)
        #: permutes redirected so far, by site ("input_dist": P1, "dist_init": P2)
        self.redirected: Counter = Counter()
        self._input_dist_done: dict[int, torch.cuda.Event] = {}
        # This pipeline's own forward class, so that its state stays per pipeline.
        self._pipelined_forward_type = type(
            "RecpipePipelinedForward",
            (RecpipePipelinedForward,),
            dict(counts=self.redirected, input_dist_done=self._input_dist_done, world_size=world),
        )

    def _init_pipelined_modules(self, batch: Any, context: Any, *args: Any, **kwargs: Any) -> None:
        with self._ring_permutes(context.index):
            super()._init_pipelined_modules(batch, context, *args, **kwargs)

    def start_sparse_data_dist(self, batch: Any, context: Any) -> None:
        with self._ring_permutes(context.index):
            super().start_sparse_data_dist(batch, context)

    def _ring_permutes(self, batch_index: int) -> PermuteInto | nullcontext:
        if not self._use_ring:
            return nullcontext()
        return _Counted(PermuteInto(self._ring.allocator(batch_index)), self.redirected)

    def wait_sparse_data_dist(self, context: Any) -> None:
        super().wait_sparse_data_dist(context)
        if self._data_dist_stream is not None:  # batch context.index's input dist is queued
            done = torch.cuda.Event()
            done.record(self._data_dist_stream)
            self._input_dist_done[context.index] = done

    def dequeue_batch(self) -> None:
        # Called on main at the end of progress(): batch contexts[0]'s work is all queued.
        self._ring.release(self.contexts[0].index)
        self._input_dist_done.pop(self.contexts[0].index, None)
        super().dequeue_batch()

    @property
    def ring_nbytes(self) -> int:
        """Bytes held by the pipeline-owned P1 buffers."""
        return self._ring.nbytes


class _Counted:
    """Enters a :class:`PermuteInto` and adds its redirected calls to ``counts["input_dist"]``."""

    def __init__(self, mode: PermuteInto, counts: Counter) -> None:
        self._mode = mode
        self._counts = counts

    def __enter__(self) -> None:
        self._mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._counts["input_dist"] += self._mode.calls
