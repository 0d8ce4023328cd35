"""The permute op's benchmark inputs (``scripts/bench_permute.py``, ``scripts/tune_permute.py``):
fbgemm-style ``permute_2D_sparse_data`` arguments of a given shape, and the bytes a permute must
move."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHAPES = {  # name -> (num_features T, batch_size B, mean pooling factor)
    "small": (170, 128, 50),
    "large": (1024, 4096, 40),
}


@dataclass
class Inputs:
    permute: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    n: int
    bytes_moved: int


def make_inputs(T: int, B: int, pooling: int, device: str, weighted: bool, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * pooling + 1, (T, B), generator=g, dtype=torch.int32)
    total = int(lengths.sum())
    values = torch.randint(0, 2**40, (total,), generator=g, dtype=torch.int64)
    weights = torch.rand(total, generator=g) if weighted else None
    permute = torch.randperm(T, generator=g).to(torch.int32)
    n = total  # a permutation keeps every row
    per_value = values.element_size() + (weights.element_size() if weighted else 0)
    bytes_moved = 2 * (n * per_value + lengths.numel() * lengths.element_size())
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Inputs(to(permute), to(lengths), to(values), to(weights), n, bytes_moved)
