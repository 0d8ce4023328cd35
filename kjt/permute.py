"""Permute KeyedJaggedTensors into buffers allocated ahead of time.

torchrec permutes KJTs with ``torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values,
weights, permuted_lengths_sum)``: in ``KeyedJaggedTensor.permute`` (the feature-order permute of
an input dist, "P1") and in ``KeyedJaggedTensor.dist_init`` (the recat after the all-to-all,
"P2"). Both pass the output size on the host (``sum(length_per_key)`` and ``values.numel()``).

:class:`PermuteInto` is a scoped ``TorchFunctionMode`` that redirects exactly those calls to
``recpipe.ops.permute_2D_sparse_data`` with preallocated outputs, leaving every other line of
torchrec untouched (so its KJT metadata, syncs and versions stay torchrec's own). It changes
nothing outside its ``with`` block and thread: no global patching, two pipelines in one process
stay independent. Calls it cannot size on the host (no ``permuted_lengths_sum``) go to fbgemm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.ops import PermuteResult, permute_into


@dataclass(frozen=True)
class PermuteSpec:
    """Everything needed to allocate the outputs of one permute, known on the host."""

    lengths_shape: tuple[int, ...]
    lengths_dtype: torch.dtype
    num_values: int
    values_dtype: torch.dtype
    weights_dtype: torch.dtype | None
    device: torch.device


@dataclass
class PermuteBuffers:
    """Output buffers of one permute; each may be larger than its spec needs (a view of the
    front is used)."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None

    def fits(self, spec: PermuteSpec) -> bool:
        need = [(self.lengths, _numel(spec.lengths_shape), spec.lengths_dtype),
                (self.values, spec.num_values, spec.values_dtype)]
        if spec.weights_dtype is not None:
            if self.weights is None:
                return False
            need.append((self.weights, spec.num_values, spec.weights_dtype))
        return all(
            t.numel() >= n and t.dtype == d and t.device == spec.device and t.is_contiguous()
            for t, n, d in need
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def permute_spec(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    permuted_lengths_sum: int,
) -> PermuteSpec:
    """The outputs of ``permute_2D_sparse_data(permute, lengths, values, weights, sum)``."""
    return PermuteSpec(
        lengths_shape=(permute.numel(), *lengths.shape[1:]),
        lengths_dtype=lengths.dtype,
        num_values=int(permuted_lengths_sum),
        values_dtype=values.dtype,
        weights_dtype=None if weights is None else weights.dtype,
        device=lengths.device,
    )


def kjt_permute_spec(kjt: KeyedJaggedTensor, indices: list[int]) -> PermuteSpec:
    """The outputs of ``kjt.permute(indices)``, from host metadata (``length_per_key``, which
    ``KeyedJaggedTensor.permute`` computes anyway)."""
    length_per_key = kjt.length_per_key()
    weights = kjt.weights_or_none()
    return PermuteSpec(
        lengths_shape=(len(indices), kjt.stride()),
        lengths_dtype=kjt.lengths().dtype,
        num_values=sum(length_per_key[i] for i in indices),
        values_dtype=kjt.values().dtype,
        weights_dtype=None if weights is None else weights.dtype,
        device=kjt.device(),
    )


def allocate(spec: PermuteSpec) -> PermuteBuffers:
    """Exact-size buffers on the current stream."""
    weights = None
    if spec.weights_dtype is not None:
        weights = torch.empty(spec.num_values, dtype=spec.weights_dtype, device=spec.device)
    return PermuteBuffers(
        lengths=torch.empty(spec.lengths_shape, dtype=spec.lengths_dtype, device=spec.device),
        values=torch.empty(spec.num_values, dtype=spec.values_dtype, device=spec.device),
        weights=weights,
    )


Allocator = Callable[[PermuteSpec], PermuteBuffers]
#: ``run(permute, lengths [T, B], values, weights, permuted_lengths_sum)``: fbgemm's results
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], PermuteResult]


def write_into(alloc: Allocator) -> Runner:
    """A runner that permutes into ``alloc(spec)``'s buffers with recpipe's op
    (:func:`recpipe.ops.permute_into`: the op's checks of the buffers are left out).

    Contract for ``alloc``: it is called on the thread and stream of the permute call and must
    return buffers that fit ``spec`` (:meth:`PermuteBuffers.fits`, contiguous), that this
    stream may write now (the caller orders their allocation or last use against this stream)
    and that stay alive as long as the result is used.
    """

    def run(
        permute: torch.Tensor,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        total: int,
    ) -> PermuteResult:
        buffers = alloc(permute_spec(permute, lengths, values, weights, total))
        return permute_into(
            permute, lengths, values, weights, total,
            buffers.lengths, buffers.values, None if weights is None else buffers.weights,
        )

    return run

# fbgemm's 2D permute under both names, as packet and as overload (torchrec calls the packet).
_FBGEMM_2D = frozenset(
    op
    for packet in (torch.ops.fbgemm.permute_2D_sparse_data, torch.ops.fbgemm.permute_sparse_data)
    for op in (packet, packet.default)
)


class PermuteInto(TorchFunctionMode):
    """Within ``with PermuteInto(run):``, fbgemm's 2D sparse permute calls that carry
    ``permuted_lengths_sum`` are done by ``run`` instead (usually ``write_into(alloc)``).
    ``calls`` counts the redirected permutes, ``seen`` every torch call the mode saw (each one
    paid a Python round trip: keep the block narrow, see :mod:`recpipe.kjt.redirect`)."""

    def __init__(self, run: Runner) -> None:
        super().__init__()
        self.run = run
        self.calls = 0
        self.seen = 0

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        kwargs = kwargs or {}
        self.seen += 1
        if func in _FBGEMM_2D:
            bound = _bind(*args, **kwargs)
            if bound is not None:
                self.calls += 1
                return self.run(*bound)
        return func(*args, **kwargs)


def _bind(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
) -> tuple | None:
    """fbgemm's arguments, or None where the output size is unknown on the host."""
    if permuted_lengths_sum is None or lengths.dim() != 2:
        return None
    return permute, lengths, values, weights, permuted_lengths_sum


def permute_kjt(
    kjt: KeyedJaggedTensor,
    indices: list[int],
    buffers: PermuteBuffers,
    indices_tensor: torch.Tensor | None = None,
) -> KeyedJaggedTensor:
    """``kjt.permute(indices)`` written into ``buffers`` (see :func:`kjt_permute_spec` for the
    sizes). The result's lengths, values and weights share the buffers' storage. Runs on the
    current stream; the caller owns the ordering of the buffers' allocation and later reads."""
    spec = kjt_permute_spec(kjt, indices)
    if not buffers.fits(spec):
        raise ValueError(f"recpipe.kjt.permute_kjt: buffers too small or of the wrong type for {spec}")
    mode = PermuteInto(write_into(lambda _: buffers))
    with mode:
        out = kjt.permute(indices, indices_tensor)
    if mode.calls != 1:  # variable stride per key takes another path in torchrec
        raise NotImplementedError("recpipe.kjt.permute_kjt: variable-stride KJTs are not supported")
    return out
