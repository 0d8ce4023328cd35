"""``TrainPipelineSparseDist`` with the KJT permutes written into memory that is reusable on time.

A drop-in subclass of torchrec's pipeline: same constructor, same ``progress()``. It changes only
where the two permutes of the sparse input distribution write (shared/DESIGN.md):

- P1, the feature-order permute in ``input_dist`` (on the data_dist stream): into a
  pipeline-owned :class:`~recpipe.pipeline.buffers.BufferRing`, one slot per batch in flight
  (3 slots for the whole permute, 2 for the split one).
  By default only at world size 1, where torchrec's all-to-all is skipped and the permuted KJT
  itself is what the main stream reads (record_stream'd); there the lengths are permuted on
  data_dist and the values into a 2-slot ring on a side stream (``split_input_dist_permute``). With more ranks the all-to-all reads
  it on data_dist and torchrec frees it right after, so for an EmbeddingBagCollection a ring
  would only add memory; an EmbeddingCollection's context (``features_before_input_dist``,
  read in its output dist) and data-parallel tables do take it to main, and keep torchrec's
  record_stream there unless ``ring_feature_permute = True``.
- P2, the recat permute in ``dist_init`` (world size > 1, data_dist stream, inside the
  pipelined forward): into buffers allocated on the main stream
  (:func:`~recpipe.pipeline.buffers.main_stream_allocator`).

Neither needs ``record_stream`` (torchrec still calls it on the KJT; for main-stream memory it is
a no-op, and ring memory is never freed while in use); the split permute's lengths (small, fresh
data_dist memory) do rely on it. Everything else is torchrec's code path,
so the losses are bit-identical: recpipe's permute gives fbgemm's results exactly.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSparseDist as _TorchrecTrainPipelineSparseDist,
)
from torchrec.distributed.types import Awaitable

from recpipe.kjt import PermuteInto, write_into
from recpipe.pipeline.buffers import BufferRing, SideWrite, main_stream_allocator
from recpipe.pipeline.compat import (
    clears_data_dist_inputs,
    dist_init_on_main_stream,
    stale_index_refs,
)


class _PermuteOnMain(Awaitable[Any]):
    """Waits ``inner`` with its KJT permutes (``dist_init``) writing into main-stream memory."""

    def __init__(self, inner: Awaitable[Any], main: torch.cuda.Stream | None, counts: Counter) -> None:
        super().__init__()
        self._inner = inner
        self._main = main
        self._counts = counts

    def _wait_impl(self) -> Any:
        mode = PermuteInto(write_into(main_stream_allocator(self._main)))
        with mode:
            result = self._inner.wait()
        self._counts["dist_init"] += mode.calls
        return result


class RecpipePipelinedForward(PipelinedForward):
    """torchrec's ``PipelinedForward`` whose input-dist wait permutes into main-stream memory.

    Streams: called on main; torchrec then waits the request on data_dist, makes main wait on
    data_dist and calls ``record_stream(main)`` on the result (a no-op for main-stream buffers;
    harmless for the ring's, which are never freed while in use).
    """

    counts: Counter = Counter()  # replaced per pipeline by TrainPipelineSparseDist

    def __call__(self, *input: Any, **kwargs: Any) -> Awaitable:
        requests = self._context.input_dist_tensors_requests
        if self._name in requests and not dist_init_on_main_stream():
            main = torch.cuda.current_stream(self._stream.device) if self._stream else None
            requests[self._name] = _PermuteOnMain(requests[self._name], main, self.counts)
        return super().__call__(*input, **kwargs)


class TrainPipelineSparseDist(_TorchrecTrainPipelineSparseDist):
    """torchrec's ``TrainPipelineSparseDist``, with the sparse permutes' outputs in memory that
    the allocator can reuse on time (see the module docstring). Same arguments and behaviour.
    """

    #: P1 ring slots, one per batch in flight (host ahead of the GPU: the batch whose step is
    #: still running, the batch in compute, the next one) when the whole permute waits for its
    #: slot on data_dist. The slot of batch i+1 is the one batch i+1-depth used, so depth 2
    #: would make the input dist of batch i+1 wait for main to finish step i-1, and the host
    #: reads data_dist right after (``wait_sparse_data_dist``: at one rank the recat is made
    #: with a synchronous ``torch.tensor(..., device=cuda)``; with more ranks the splits are
    #: read with ``.tolist()``): measured 22% slower on 1 H100.
    ring_depth: int = 3
    #: Permute the lengths on data_dist at once (fresh memory) and the values/weights into a
    #: depth-2 ring on a side stream that alone waits for the slot; data_dist waits for the
    #: values at the end of ``wait_sparse_data_dist``, after the host's read. None (default):
    #: wherever allowed, i.e. world size 1, the ring on, no row-wise tables (with more ranks the values
    #: all-to-all is queued before data_dist could wait; a row-wise input dist bucketizes the
    #: values on data_dist). Measured on 1 H100, large config (README): 0.99x torchrec's
    #: ms/iter, 990 MiB less peak reserved; the depth-3 ring: 0.995x, +28 MiB.
    split_input_dist_permute: bool | None = None
    #: P1 into the ring: None (default) = at world size 1 only (see the module docstring).
    ring_feature_permute: bool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cuda = self._device.type == "cuda"
        main = torch.cuda.current_stream(self._device) if cuda else None
        world = _world_size(self._model)
        ring = world == 1 if self.ring_feature_permute is None else self.ring_feature_permute
        self._use_ring = ring and not clears_data_dist_inputs(self)
        split = self.split_input_dist_permute
        if split is None:
            split = self._use_ring and world == 1 and not _bucketized(self._model)
        elif split:
            if world > 1:
                raise ValueError(
                    "split_input_dist_permute needs world size 1: with more ranks the values "
                    "all-to-all is queued before data_dist could wait for the values"
                )
            if _bucketized(self._model):
                raise ValueError(
                    "split_input_dist_permute: a row-wise input dist bucketizes the values on "
                    "data_dist before data_dist could wait for them"
                )
            if not self._use_ring:
                raise ValueError("split_input_dist_permute needs the ring (ring_feature_permute)")
        self.split_input_dist_permute = split  # resolved: what this pipeline does
        if split:
            self._side = torch.cuda.Stream(self._device, priority=-1) if cuda else None
            self._values_done: dict[int, list[SideWrite]] = {}
        self._ring = BufferRing(
            main, 2 if split else self.ring_depth, stale_refs=stale_index_refs(self._model)
        )
        #: permutes redirected so far, by site ("input_dist": P1, "dist_init": P2)
        self.redirected: Counter = Counter()
        if world > 1:  # P2, the recat after the all-to-all: only with more than one rank
            # This pipeline's own forward class, so that counts stay per pipeline.
            self._pipelined_forward_type = type(
                "RecpipePipelinedForward", (RecpipePipelinedForward,), {"counts": self.redirected}
            )

    def start_sparse_data_dist(self, batch: Any, context: Any) -> None:
        # Every input dist starts here, the first batch's too (torchrec 1.6 and 1.8 call it
        # from _pipeline_model); on data_dist.
        with self._ring_permutes(context.index):
            super().start_sparse_data_dist(batch, context)

    def _ring_permutes(self, batch_index: int) -> PermuteInto | nullcontext:
        if not self._use_ring:
            return nullcontext()
        if self.split_input_dist_permute:
            done = self._values_done.setdefault(batch_index, [])
            run = self._ring.split_runner(batch_index, self._side, done)
        else:
            run = write_into(self._ring.allocator(batch_index))
        return _Counted(PermuteInto(run), self.redirected)

    def wait_sparse_data_dist(self, context: Any) -> None:
        super().wait_sparse_data_dist(context)
        if self.split_input_dist_permute:  # the splits are read: now data_dist needs the values
            for write in self._values_done.pop(context.index, []):  # none on CPU
                self._data_dist_stream.wait_event(write.event)  # then its inputs may go

    def dequeue_batch(self) -> None:
        # Called on main at the end of progress(): batch contexts[0]'s work is all queued.
        self._ring.release(self.contexts[0].index)
        super().dequeue_batch()

    @property
    def ring_nbytes(self) -> int:
        """Bytes held by the pipeline-owned P1 buffers."""
        return self._ring.nbytes

    @property
    def ring_replaced(self) -> int:
        """P1 buffers given new memory because a result of an earlier batch still used them."""
        return self._ring.replaced


def _bucketized(model: torch.nn.Module) -> bool:
    """Whether a table of the (DistributedModelParallel) plan is row-wise in some form, so that
    its input dist reads the permuted values on data_dist (bucketize) in ``input_dist``."""
    plan = getattr(model, "plan", None)
    return plan is not None and any(
        "row_wise" in p.sharding_type or p.sharding_type == "grid_shard"
        for module_plan in plan.plan.values()
        for p in module_plan.values()
    )


def _world_size(model: torch.nn.Module) -> int:
    """The sharded model's world size (DistributedModelParallel's), else the default group's."""
    env = getattr(model, "_env", None)
    if env is not None:
        return env.world_size
    return dist.get_world_size() if dist.is_initialized() else 1


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
