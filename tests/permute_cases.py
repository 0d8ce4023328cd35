"""Random inputs for the permute tests, and the fbgemm references."""

from __future__ import annotations

from dataclasses import dataclass

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch


@dataclass
class Case:
    permute: torch.Tensor
    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None

    def args(self) -> tuple:
        return (self.permute, self.lengths, self.values, self.weights)

    def to(self, device: torch.device | str) -> "Case":
        w = None if self.weights is None else self.weights.to(device)
        return Case(self.permute.to(device), self.lengths.to(device), self.values.to(device), w)


def make_case(
    T: int,
    B: int | None,
    T_out: int,
    *,
    max_len: int = 6,
    index_dtype: torch.dtype = torch.int32,
    permute_dtype: torch.dtype = torch.int32,
    values_dtype: torch.dtype = torch.int64,
    weights_dtype: torch.dtype | None = torch.float32,
    extra_values: int = 0,
    seed: int = 0,
) -> Case:
    """``B=None`` gives 1D lengths. Values are random (never zeros or a plain arange)."""
    g = torch.Generator().manual_seed(seed)
    shape = (T,) if B is None else (T, B)
    lengths = torch.randint(0, max_len + 1, shape, generator=g).to(index_dtype)
    n = int(lengths.sum()) + extra_values
    if values_dtype.is_floating_point:
        values = torch.randn(n, generator=g).to(values_dtype)
    else:
        values = torch.randint(-(2**30), 2**30, (n,), generator=g).to(values_dtype)
    weights = None if weights_dtype is None else torch.rand(n, generator=g).to(weights_dtype)
    permute = torch.randint(0, max(T, 1), (T_out,), generator=g).to(permute_dtype)
    if T == 0:
        permute = permute[:0]
    return Case(permute, lengths, values, weights)


def fbgemm_reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fbgemm on CPU (1D lengths through its 1D op; its permute must be int32)."""
    c = case.to("cpu")
    op = torch.ops.fbgemm.permute_1D_sparse_data if c.lengths.dim() == 1 else (
        torch.ops.fbgemm.permute_2D_sparse_data
    )
    values = c.values[: int(c.lengths.sum())]
    weights = None if c.weights is None else c.weights[: values.numel()]
    # fbgemm's 1D CPU op has no float16 weights: permute them as float32 (exact for a copy).
    w32 = None if weights is None else weights.float()
    lengths, values, w = op(c.permute.to(torch.int32), c.lengths, values, w32, None)
    return lengths, values, None if w is None else w.to(weights.dtype)


# fbgemm_gpu >= 1.8: its own op with preallocated outputs (CPU in CI).
HAS_FBGEMM_PREALLOCATED_OUT = hasattr(torch.ops.fbgemm, "permute_2D_sparse_preallocated_out")


def fbgemm_preallocated_out(
    case: Case, n: int | None, outs: tuple
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fbgemm.permute_2D_sparse_preallocated_out on CPU into the CPU buffers ``outs`` (2D lengths
    only; its permute must be int32). It returns the buffers whole, in the shape they were given."""
    c = case.to("cpu")
    op = torch.ops.fbgemm.permute_2D_sparse_preallocated_out
    return op(c.permute.to(torch.int32), c.lengths, c.values, c.weights, n, *outs)
