"""Backend and device of one rank, for the tests' and benchmarks' process groups."""

from __future__ import annotations

import os

import torch

SHARED_GPU_ENV = "RECPIPE_SHARED_GPU"


def rank_backend_device(local_rank: int, local_world: int) -> tuple[str, torch.device]:
    """``(backend, device)`` for ``local_rank`` of ``local_world`` ranks on this host.

    - One GPU per rank: NCCL on ``cuda:local_rank``.
    - Otherwise gloo on the CPU, unless ``RECPIPE_SHARED_GPU=1`` and a GPU exists: then gloo
      with the ranks sharing the GPUs (``cuda:local_rank % device_count``). That mode runs the
      multi-rank code paths (the all-to-all, the recat permute after it) on real CUDA streams
      where fewer GPUs than ranks are lent. It is for correctness only: gloo moves CUDA
      tensors through host memory, so timings mean nothing; per-process memory still does.
    """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= local_world:
        return "nccl", torch.device("cuda", local_rank)
    if n and os.environ.get(SHARED_GPU_ENV) == "1":
        return "gloo", torch.device("cuda", local_rank % n)
    return "gloo", torch.device("cpu")
