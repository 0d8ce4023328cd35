"""The pipelines a benchmark can run, by name, each built only from public switches (torchrec's
constructor options, recpipe's class attributes): ``PIPELINES[name](model, optimizer, device)``.

Anchors: ``torchrec`` (``TrainPipelineSparseDist``, the time anchor), ``torchrec_base``
(``TrainPipelineBase``: no overlap, the memory floor), ``torchrec_lite``
(``TrainPipelineSparseDistLite``: one batch in flight, the input dist on main), and torchrec with
its own memory options (``torchrec_early_free``, ``torchrec_clear_inputs``, ``torchrec_inplace``,
``torchrec_free_clear``, ``torchrec_lean``: all of them; ``torchrec_async``: 1.9's copy worker).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable

import torchrec
from torchrec.distributed.train_pipeline import TrainPipelineBase
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDistLite

from recpipe.pipeline import TrainPipelineSparseDist as RecpipePipeline
from recpipe.pipeline.data_parallel import BucketedAllReduce


def _variant(name: str, **switches: object) -> type[RecpipePipeline]:
    """recpipe's pipeline with class attributes ``switches`` set."""
    return type(name, (RecpipePipeline,), dict(switches))


def _with_options(cls: Callable, **options: object) -> Callable:
    """``cls`` with torchrec's pipeline options set, where the installed torchrec has them
    (``free_features_storage_early``, ``clear_data_dist_inputs``: >= 1.7; ``async_inplace_copy``: 1.9)."""
    params = inspect.signature(TorchrecPipeline).parameters
    missing = [k for k in options if k not in params]

    def make(*args, **kwargs):
        if missing:
            raise SystemExit(f"error: this torchrec ({torchrec.__version__}) has no "
                             f"{', '.join(missing)}: pick another variant")
        return cls(*args, **options, **kwargs)

    return make


_EARLY_FREE = dict(free_features_storage_early=True)
_ASYNC = dict(enable_inplace_copy_batch=True, async_inplace_copy=True)  # torchrec >= 1.9
_LEAN = dict(enable_inplace_copy_batch=True, free_features_storage_early=True,
             clear_data_dist_inputs=True)
# the ring and the early frees for every batch, however small (sanitizer and ablation runs)
_ALWAYS = dict(min_batch_bytes=0)
_RING = dict(ring_feature_permute=True, **_ALWAYS)  # also on CPU
_A2A_MAIN = _variant("RecpipeA2AMain", all_to_all_outputs_on_main=True)

PIPELINES: dict[str, Callable] = {
    "torchrec": TorchrecPipeline,
    "torchrec_base": TrainPipelineBase,
    "torchrec_lite": TrainPipelineSparseDistLite,
    "torchrec_inplace": _with_options(TorchrecPipeline, enable_inplace_copy_batch=True),
    "torchrec_early_free": _with_options(TorchrecPipeline, **_EARLY_FREE),
    "torchrec_clear_inputs": _with_options(TorchrecPipeline, clear_data_dist_inputs=True),
    "torchrec_free_clear": _with_options(TorchrecPipeline, **_EARLY_FREE, clear_data_dist_inputs=True),
    "torchrec_lean": _with_options(TorchrecPipeline, **_LEAN),
    "torchrec_async": _with_options(TorchrecPipeline, **_ASYNC),
    "recpipe": RecpipePipeline,
    "recpipe_always": _variant("RecpipeAlways", **_ALWAYS),
    "recpipe_inplace": _variant("RecpipeInplace", inplace_copy_batch=True),
    "recpipe_no_early_free": _variant("RecpipeNoEarlyFree", free_inputs_early=False),
    "recpipe_no_copy_ring": _variant("RecpipeNoCopyRing", copy_ring=False),
    "recpipe_copy_ring2": _variant("RecpipeCopyRing2", copy_ring_depth=2),
    "recpipe_exact_sizes": _variant("RecpipeExactSizes", stable_sizes=False),
    "recpipe_exact_recat": _variant("RecpipeExactRecat", stable_recat_sizes=False),
    "recpipe_no_permuted_copy": _variant("RecpipeNoPermutedCopy", permuted_copy=False),
    "recpipe_dist_after_forward": _variant("RecpipeDistAfterForward", input_dist_after_forward=True),
    "recpipe_always_dist_after_forward": _variant(  # (the sanitizer's tiny config)
        "RecpipeAlwaysDistAfterForward", input_dist_after_forward=True, **_ALWAYS),
    "recpipe_permuted_copy": _variant("RecpipePermutedCopy", permuted_copy=True),  # row-wise too
    # every switch off at world size 1: torchrec's path through recpipe's class (its own cost)
    "recpipe_off": _variant("RecpipeOff", ring_feature_permute=False, free_inputs_early=False),
    "recpipe_a2a_main": _A2A_MAIN,
    "recpipe_a2a_main_lean": _with_options(_A2A_MAIN, **_LEAN),
    "recpipe_early_free": _with_options(RecpipePipeline, **_EARLY_FREE),  # + torchrec's option
    "recpipe_lean": _with_options(RecpipePipeline, **_LEAN),  # + all of torchrec's options
    "recpipe_async": _with_options(RecpipePipeline, **_ASYNC),  # + torchrec's copy worker
    # world size 1: the whole P1 into a depth-3 ring (depth 2: the host waits for main)
    "recpipe_ring3": _variant("RecpipeRing3", split_input_dist_permute=False, **_RING),
    "recpipe_ring2": _variant("RecpipeRing2", split_input_dist_permute=False, ring_depth=2, **_RING),
    "recpipe_ring": _variant("RecpipeRing", **_RING),  # also on several ranks
    "recpipe_nccl_ar": RecpipePipeline,
    "recpipe_symm_ar": RecpipePipeline,
    "recpipe_auto_ar": RecpipePipeline,
}

#: The dense part's gradient all-reduce (default: torchrec's DDP): recpipe's compiled bucketed
#: all-reduce through NCCL (gloo on CPU), through symmetric memory (CUDA, one host), or per
#: bucket the fastest of the two in the machine's measured table (recpipe.ops.all_reduce_table).
DENSE_ALLREDUCE: dict[str, Callable[[], BucketedAllReduce]] = {
    "recpipe_nccl_ar": lambda: BucketedAllReduce(compile=True),
    "recpipe_symm_ar": lambda: BucketedAllReduce(algorithm="symm_mem"),
    "recpipe_auto_ar": lambda: BucketedAllReduce(algorithm="auto"),
}


def pipeline_names(text: str) -> list[str]:
    """A ``--pipelines`` argument (comma-separated): known names only, checked before anything
    is built (an ``argparse`` type)."""
    names = text.split(",")
    unknown = [n for n in names if n not in PIPELINES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: pick from {', '.join(PIPELINES)}")
    return names
