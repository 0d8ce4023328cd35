"""recpipe.pipeline: torchrec training pipelines without the record_stream memory tax."""

from recpipe.pipeline.plan import MemoryPlan
from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist

__all__ = ["MemoryPlan", "TrainPipelineSparseDist"]
