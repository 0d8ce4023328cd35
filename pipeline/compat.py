"""The one place for torchrec version differences (1.6-1.9 on the GPU machine, 1.9 and 1.8 in
CI)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchrec
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_PIPELINE_PARAMS = inspect.signature(TrainPipelineSparseDist.__init__).parameters


def pipeline_options(**options: Any) -> dict[str, Any]:
    """The keyword arguments of torchrec's ``TrainPipelineSparseDist`` that the installed
    torchrec takes: an option it lacks (``free_features_storage_early``,
    ``clear_data_dist_inputs``: not in torchrec 1.6; ``async_inplace_copy``: >= 1.9) is dropped
    at its default (False) and refused otherwise."""
    for name, value in options.items():
        if name not in _PIPELINE_PARAMS and value:
            raise TypeError(
                f"recpipe TrainPipelineSparseDist: {name}={value!r} needs a torchrec that has it "
                f"(installed: {torchrec.__version__}): upgrade torchrec or leave it unset"
            )
    return {name: value for name, value in options.items() if name in _PIPELINE_PARAMS}


def dist_init_on_main_stream() -> bool:
    """torchrec >= 1.8 with ``clear_data_dist_inputs=True`` runs ``dist_init`` on the main
    stream (``PipelinedForward._use_main_stream_for_dist_init``): nothing to move then."""
    return bool(getattr(PipelinedForward, "_use_main_stream_for_dist_init", False))


def all_to_all_awaitables(request: Awaitable) -> Iterator[KJTAllToAllTensorsAwaitable]:
    """The KJT all-to-alls with more than one worker that an input-dist tensors request (a
    ``KJTListAwaitable`` per sharded module, or one of them) waits on (torchrec 1.6 and 1.8):
    their ``_wait_impl`` ends in ``type(self._input).dist_init(...)``, the recat (P2)."""
    stack = [request]
    while stack:
        awaitable = stack.pop()
        if isinstance(awaitable, KJTAllToAllTensorsAwaitable):
            if awaitable._workers > 1:
                yield awaitable
        else:
            stack.extend(getattr(awaitable, "awaitables", ()))


def all_to_all_input(awaitable: KJTAllToAllTensorsAwaitable) -> KeyedJaggedTensor:
    """The KJT whose class ``dist_init`` is looked up on (torchrec 1.6 and 1.8: ``_input``)."""
    return awaitable._input


def release_all_to_all_input(awaitable: KJTAllToAllTensorsAwaitable) -> None:
    """Drop ``awaitable``'s references to the tensors it sent; waits for its all-to-all on the
    current stream first (c10d ``Work.wait``: NCCL makes the stream wait, no host sync; gloo
    returns when done) and drops the works: the stream that later waits the awaitable (the same
    data_dist) is already ordered after them. What ``_wait_impl`` still reads of its input (the
    class, ``variable_stride_per_key``) is kept. Storage is not resized: the memory goes when
    its last holder does, so other views (an EmbeddingCollection's context, the batch's own
    KJT when ``split`` returned it whole) stay valid. torchrec 1.6 and 1.8 (``_input``,
    ``_awaitables``; 1.8 also ``_input_tensors``)."""
    for work in awaitable._awaitables:
        work.wait()
    awaitable._awaitables = []  # the works themselves hold the tensors (gloo) until dropped
    hollow = copy.copy(awaitable._input)
    for name, value in vars(hollow).items():
        if isinstance(value, torch.Tensor):
            setattr(hollow, name, value.new_empty(0))
    awaitable._input = hollow
    if hasattr(awaitable, "_input_tensors"):
        awaitable._input_tensors = []


def drop_cached_views(kjt: KeyedJaggedTensor) -> None:
    """Forget ``kjt``'s ``to_dict()`` cache (``_jt_dict``, torchrec 1.6-1.9): views of its values
    and lengths that keep their memory alive after the pipeline released the KJT (torchrec's
    input validation calls ``to_dict()`` on each sharded module's first batch)."""
    if getattr(kjt, "_jt_dict", None) is not None:
        kjt._jt_dict = None


def copies_or_frees_inputs_itself(pipeline: object) -> bool:
    """torchrec's own ``enable_inplace_copy_batch`` (1.8+, its async copy worker with 1.9) or
    ``free_features_storage_early`` (1.7+; it resizes the input KJTs to 0 bytes inside
    ``start_sparse_data_dist``): the batch copy or the inputs' memory are then torchrec's."""
    return bool(
        getattr(pipeline, "_enable_inplace_copy_batch", False)
        or getattr(pipeline, "_free_features_storage_early", False)
    )


def clears_data_dist_inputs(pipeline: object) -> bool:
    """torchrec >= 1.8's ``clear_data_dist_inputs`` frees the all-to-all inputs' storage in
    place (``storage().resize_(0)``), which a pipeline-owned ring must not see."""
    return bool(getattr(pipeline, "_clear_data_dist_inputs", False))


def async_copy_executor(pipeline: object) -> Any:
    """torchrec >= 1.9's ``async_inplace_copy`` worker (a one-thread executor that dispatches
    the in-place batch copies, whose results the pipeline's ``batches`` deque resolves when
    read), or None where it is off, unavailable (CPU) or absent (torchrec < 1.9)."""
    if not getattr(pipeline, "_async_inplace_copy", False):
        return None
    return getattr(pipeline, "_inplace_copy_executor", None)


def stale_index_refs(model: torch.nn.Module) -> Callable[[torch.Tensor], int]:
    """Counts, for a tensor, the other tensors on its memory that fbgemm's table-batched
    embedding modules keep alive after their forward: ``_indices``, the last batch's indices
    (fbgemm 1.6 and 1.8; read again only within that batch's step: writeback hook, cache
    prefetch), and the base tensor each such view keeps alive. The modules are looked up once
    (torchrec makes them when it shards the model)."""
    tbes = list(_tbe_modules(model))

    def count(t: torch.Tensor) -> int:
        ptr = t.untyped_storage().data_ptr()
        kept: dict[int, torch.Tensor] = {}
        for m in tbes:
            x = getattr(m, "_indices", None)
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == ptr:
                kept[id(x)] = x
                if x._base is not None and x._base is not t:
                    kept[id(x._base)] = x._base
        return len(kept)

    return count


def _tbe_modules(model: torch.nn.Module) -> Iterator[SplitTableBatchedEmbeddingBagsCodegen]:
    # torchrec's sharded modules keep their lookups in a plain list (``_lookups``), outside
    # ``modules()``; the lookups hold the TBEs (torchrec 1.6 and 1.8).
    for module in model.modules():
        for lookup in getattr(module, "_lookups", ()):
            for m in lookup.modules():
                if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
                    yield m
