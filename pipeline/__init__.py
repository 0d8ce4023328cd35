"""recpipe.pipeline: torchrec training pipelines without the record_stream memory tax.

torchrec is no dependency of the wheel's (its declared fbgemm-gpu is CUDA's, which fails to
load on CPU): where it, or a package it imports, is missing, importing this package raises an
ImportError (``name="torchrec"``) whose one-line message says how to install it on CPU and GPU.
"""

try:
    import torchrec  # noqa: F401
except ModuleNotFoundError as e:
    raise ImportError(
        f"recpipe.pipeline needs torchrec ({e}): on CPU, pip install fbgemm-gpu-cpu tensordict "
        "torchmetrics tqdm pyre-extensions, then pip install --no-deps torchrec (the releases "
        "matching your torch, as scripts/setup_venv.sh pins them); on GPU, pip install "
        "'recpipe[torchrec]'", name="torchrec") from None

from recpipe.pipeline.plan import MemoryPlan
from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist

__all__ = ["MemoryPlan", "TrainPipelineSparseDist"]
