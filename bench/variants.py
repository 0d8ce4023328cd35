"""The pipelines a benchmark can run, by name: ``PIPELINES[name](model, optimizer, device)``. Each
is built from public switches (torchrec's constructor options, recpipe's ``memory_plan`` and
``min_batch_bytes``), except the ablations, which set placements through the pipeline's private
``_placements``.

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
from dataclasses import fields

import torchrec
from torchrec.distributed.train_pipeline import TrainPipelineBase
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDistLite

from recpipe.pipeline import MemoryPlan
from recpipe.pipeline import TrainPipelineSparseDist as RecpipePipeline
from recpipe.pipeline.data_parallel import BucketedAllReduce
from recpipe.pipeline.plan import Placements


def _variant(name: str, min_batch_bytes: int | None = None, **plan: str) -> type[RecpipePipeline]:
    """recpipe's pipeline with the fields ``plan`` set (and ``min_batch_bytes``): the user's
    (:class:`MemoryPlan`'s) in ``memory_plan``, the others in the private ``_placements``."""
    public = {f.name for f in fields(MemoryPlan)}
    attrs: dict[str, object] = {
        "memory_plan": MemoryPlan(**{k: v for k, v in plan.items() if k in public}),
        "_placements": Placements(**{k: v for k, v in plan.items() if k not in public}),
    }
    if min_batch_bytes is not None:
        attrs["min_batch_bytes"] = min_batch_bytes
    return type(name, (RecpipePipeline,), attrs)


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
    # the plan for every batch, however small (sanitizer runs)
    "recpipe_always": _variant("RecpipeAlways", min_batch_bytes=0),
    "recpipe_always_dist_after_forward": _variant(  # (the sanitizer's tiny config)
        "RecpipeAlwaysDistAfterForward", min_batch_bytes=0, input_dist="after_forward"),
    # one placement against the default (ablations)
    "recpipe_no_early_free": _variant("RecpipeNoEarlyFree", free_inputs=False),
    "recpipe_fresh_inputs": _variant("RecpipeFreshInputs", inputs="fresh"),
    "recpipe_copy_ring": _variant("RecpipeCopyRing", inputs="ring"),  # instead of permuted
    "recpipe_exact_sizes": _variant("RecpipeExactSizes", p1="fresh", received="exact"),
    "recpipe_exact_recat": _variant("RecpipeExactRecat", recat="exact"),
    "recpipe_recat_ring": _variant("RecpipeRecatRing", recat="ring"),  # world size > 1
    "recpipe_recat_ring_after_forward": _variant(
        "RecpipeRecatRingAfterForward", recat="ring", input_dist="after_forward"),
    "recpipe_dist_after_forward": _variant("RecpipeDistAfterForward", input_dist="after_forward"),
    "recpipe_permuted_copy": _variant("RecpipePermutedCopy", inputs="permuted"),  # any plan
    # the whole P1 into the depth-3 ring, for every batch (on CPU and several ranks too)
    "recpipe_ring": _variant("RecpipeRing", min_batch_bytes=0, p1="ring"),
    # every placement torchrec's at world size 1: torchrec's path through recpipe's class
    "recpipe_off": _variant("RecpipeOff", p1="fresh", inputs="fresh", free_inputs=False),
    "recpipe_early_free": _with_options(RecpipePipeline, **_EARLY_FREE),  # + torchrec's option
    "recpipe_lean": _with_options(RecpipePipeline, **_LEAN),  # + all of torchrec's options
    "recpipe_async": _with_options(RecpipePipeline, **_ASYNC),  # + torchrec's copy worker
    "recpipe_nccl_ar": RecpipePipeline,
    "recpipe_symm_ar": RecpipePipeline,
    "recpipe_auto_ar": RecpipePipeline,
}

#: The dense part's gradient all-reduce (default: torchrec's DDP): recpipe's BucketedAllReduce,
#: DDP with a communication hook: NCCL (DDP itself), symmetric memory (CUDA, one host), or per
#: bucket the fastest of the two in the machine's measured table (recpipe.ops.all_reduce_table).
DENSE_ALLREDUCE: dict[str, Callable[[], BucketedAllReduce]] = {
    "recpipe_nccl_ar": lambda: BucketedAllReduce(),
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
