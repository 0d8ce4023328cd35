"""The one place for torchrec version differences (1.6 on the GPU machine, 1.8 in CI)."""

from __future__ import annotations

from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward


def dist_init_on_main_stream() -> bool:
    """torchrec >= 1.8 with ``clear_data_dist_inputs=True`` runs ``dist_init`` on the main
    stream (``PipelinedForward._use_main_stream_for_dist_init``): nothing to move then."""
    return bool(getattr(PipelinedForward, "_use_main_stream_for_dist_init", False))


def clears_data_dist_inputs(pipeline: object) -> bool:
    """torchrec >= 1.8's ``clear_data_dist_inputs`` frees the all-to-all inputs' storage in
    place (``storage().resize_(0)``), which a pipeline-owned ring must not see."""
    return bool(getattr(pipeline, "_clear_data_dist_inputs", False))
