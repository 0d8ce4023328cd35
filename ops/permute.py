"""``recpipe::permute_2D_sparse_data``: fbgemm's sparse permute, with optional preallocated outputs.

Layout of the library entries (a custom op may not return an alias of an input, so the zero-copy
contract is split):

- ``recpipe::_permuted_lengths_sum(permute, lengths) -> SymInt``: the size of the permuted
  values. Syncs with the device once, checks the permute range and that no length is negative.
  Fake: an unbacked size.
- ``recpipe::_permute_2D_sparse_data_into(...) -> ()``: writes the permuted lengths, values and
  weights into the front of the given buffers. Never syncs on CUDA. Fake: nothing.
- ``recpipe::_permute_2D_sparse_data_functional(permute, lengths, values, weights, n)``: the
  same into new tensors, with an autograd formula for ``values`` and ``weights`` (a mutating op
  cannot have one). Used when autograd must record the permute.
- ``recpipe::permute_2D_sparse_data`` and its legacy name ``recpipe::permute_sparse_data``: the
  public op, ``CompositeImplicitAutograd``. It validates metadata, allocates what the caller did
  not pass, calls the primitives above and returns the buffers (views of their front when they
  are larger than needed).

Semantics match ``torch.ops.fbgemm.permute_2D_sparse_data`` for 2D lengths ``[T, B]`` and
``fbgemm.permute_1D_sparse_data`` for 1D lengths ``[T]``: output row ``t'`` is input row
``permute[t']`` (rows may be dropped or repeated).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from recpipe.ops import permute_triton

_LIB = torch.library.Library("recpipe", "DEF")
_PUBLIC_SCHEMA = (
    "(Tensor permute, Tensor lengths, Tensor values, Tensor? weights=None, "
    "SymInt? permuted_lengths_sum=None, Tensor(a!)? permuted_lengths_out=None, "
    "Tensor(b!)? permuted_indices_out=None, Tensor(c!)? permuted_weights_out=None) "
    "-> (Tensor, Tensor, Tensor?)"
)
_INDEX_DTYPES = (torch.int32, torch.int64)
_OP = "recpipe.permute_2D_sparse_data"
_OUT_NAMES = ("permuted_lengths_out", "permuted_indices_out", "permuted_weights_out")
_STATUS_MESSAGE = (
    f"{_OP}: permute index out of [0, lengths.size(0)), a negative length, permuted_lengths_sum "
    "!= sum of the permuted lengths, or lengths sum to more than values.numel()"
)

PermuteResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _as_rows(lengths: torch.Tensor) -> torch.Tensor:
    """``lengths`` as ``[T, B]`` (a 1D ``[T]`` is ``[T, 1]``)."""
    return lengths if lengths.dim() == 2 else lengths.view(-1, 1)


def _out_shape(permute: torch.Tensor, lengths: torch.Tensor) -> tuple[int, ...]:
    return (permute.numel(), *lengths.shape[1:])


def _fail(error: type[Exception], message: str) -> None:
    raise error(f"{_OP}: {message}")


def _head(t: torch.Tensor) -> str:
    """The first values of 1D ``t``, for an error message."""
    return f"{t[:8].tolist()}{' ...' if t.numel() > 8 else ''}"


def _check_inputs(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    permuted_lengths_sum: int | None,
) -> None:
    """Metadata-only checks of the inputs (no device access: they also run on fake tensors).

    Plain ``if``s on static metadata: cheap on the eager hot path, and valid while tracing.
    """
    if permute.dtype not in _INDEX_DTYPES:
        _fail(TypeError, f"permute must be int32 or int64, got {permute.dtype}")
    if lengths.dtype not in _INDEX_DTYPES:
        _fail(TypeError, f"lengths must be int32 or int64, got {lengths.dtype}")
    if permute.dim() != 1:
        _fail(ValueError, f"permute must be 1D, got shape {tuple(permute.shape)}")
    if lengths.dim() not in (1, 2):
        _fail(ValueError, f"lengths must be 1D [T] or 2D [T, B], got shape {tuple(lengths.shape)}")
    if values.dim() != 1:
        _fail(ValueError, f"values must be 1D, got shape {tuple(values.shape)}")
    if weights is not None and weights.shape != values.shape:
        _fail(
            ValueError,
            f"weights must have the shape of values {tuple(values.shape)}, "
            f"got {tuple(weights.shape)}",
        )
    device = lengths.device
    for name, t in (("permute", permute), ("values", values), ("weights", weights)):
        if t is not None and t.device != device:
            _fail(ValueError, f"{name} must be on the device of lengths ({device}), got {t.device}")
    if type(permuted_lengths_sum) is int:  # eager: a plain comparison (host time)
        if permuted_lengths_sum < 0:
            _fail(ValueError, f"permuted_lengths_sum must be >= 0, got {permuted_lengths_sum}")
    elif permuted_lengths_sum is not None:
        torch._check_value(
            permuted_lengths_sum >= 0,
            lambda: f"{_OP}: permuted_lengths_sum must be >= 0, got {permuted_lengths_sum}",
        )


def _check_out(
    name: str, out: torch.Tensor, like: torch.Tensor, numel: int | torch.SymInt
) -> None:
    """``out`` must match ``like`` in dtype and device, be contiguous and hold ``numel``."""
    if out.dtype != like.dtype:
        _fail(TypeError, f"{name} must have dtype {like.dtype}, got {out.dtype}")
    if out.device != like.device:
        _fail(ValueError, f"{name} must be on device {like.device}, got {out.device}")
    if not out.is_contiguous():
        _fail(ValueError, f"{name} must be contiguous, got strides {out.stride()}")
    have = out.numel()
    if isinstance(numel, int) and isinstance(have, int):  # eager: a plain comparison
        if numel > have:
            _fail(ValueError, f"{name} is too small: needs at least {numel} elements, has {have}")
    else:  # may be an unbacked size under torch.compile: a _check, not an ``if``
        torch._check_value(
            numel <= have,
            lambda: f"{_OP}: {name} is too small: needs at least {numel} elements, has {have}",
        )


def _outputs(
    lengths_shape: tuple[int, ...],
    n: int | torch.SymInt,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    given: Sequence[torch.Tensor | None] = (None, None, None),
) -> list[torch.Tensor | None]:
    """The ``given`` out-buffers (lengths, values, weights), checked; new exact-size tensors
    for those not given (``None`` for the weights when there are none)."""
    outs = []
    for name, buf, like, shape in zip(
        _OUT_NAMES, given, (lengths, values, weights), (lengths_shape, (n,), (n,))
    ):
        if like is None:
            outs.append(None)
        elif buf is None:
            outs.append(like.new_empty(shape))
        else:
            _check_out(name, buf, like, math.prod(shape))
            outs.append(buf)
    return outs


def _front(buf: torch.Tensor, shape: tuple[int | torch.SymInt, ...]) -> torch.Tensor:
    """A view of the first elements of contiguous ``buf`` with ``shape`` (same data_ptr).

    ``buf`` itself when it has ``shape`` and all sizes are plain ints (eager); otherwise always a
    view: comparing symbolic shapes would guard on the unbacked output size under torch.compile.
    """
    numel = math.prod(shape)
    if type(numel) is int and buf.shape == shape:
        return buf
    if buf.dim() == len(shape) == 1:  # one op instead of three (host time)
        return buf.narrow(0, 0, numel)
    return buf.view(-1).narrow(0, 0, numel).view(shape)


def _fronts(
    outs: Sequence[torch.Tensor | None], lengths_shape: tuple[int, ...], n: int | torch.SymInt
) -> PermuteResult:
    """The results in the front of the buffers ``(lengths_out, values_out, weights_out)``."""
    lengths_out, values_out, weights_out = outs
    weights = None if weights_out is None else _front(weights_out, (n,))
    return _front(lengths_out, lengths_shape), _front(values_out, (n,)), weights


# --- primitive 1: the output size (syncs) ------------------------------------------------------


def _lengths_sum(permute: torch.Tensor, lengths: torch.Tensor) -> int:
    """Sum of the permuted lengths; raises on an out-of-range permute or a negative length.
    One device sync."""
    rows = _as_rows(lengths)
    T = rows.shape[0]
    row_sums = rows.sum(dim=1, dtype=torch.int64)
    in_range = (permute >= 0) & (permute < T)
    safe = torch.where(in_range, permute, 0).to(torch.int64)
    total = torch.where(in_range, row_sums.index_select(0, safe) if T else 0, 0).sum()
    n_bad, n_negative, total = torch.stack([(~in_range).sum(), (rows < 0).sum(), total]).tolist()
    if n_bad:
        _raise_out_of_range(permute, T)
    if n_negative:
        _raise_negative_lengths(rows)
    return total


def _raise_out_of_range(permute: torch.Tensor, T: int) -> None:
    bad = permute[(permute < 0) | (permute >= T)]
    _fail(
        IndexError,
        f"permute index out of range: expected values in [0, {T}) (T = lengths.size(0)), "
        f"got {_head(bad)}",
    )


def _raise_negative_lengths(lengths: torch.Tensor) -> None:
    _fail(ValueError, f"lengths must be >= 0, got {_head(lengths[lengths < 0])}")


_lengths_sum_op = torch.library.custom_op(
    "recpipe::_permuted_lengths_sum", _lengths_sum, mutates_args=()
)


@_lengths_sum_op.register_fake
def _(permute: torch.Tensor, lengths: torch.Tensor) -> torch.SymInt:
    return torch.library.get_ctx().new_dynamic_size()


# --- primitive 2: the permute into given buffers ------------------------------------------------
# Device kernels: ``rows [T, B]`` into the fronts ``rows_out [T', B]``, ``values_out [n]``,
# ``weights_out [n]``, all contiguous on one device.


def _permute_cpu(
    permute: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    rows_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> None:
    """Checks the data on the host (a few small ops and two ``tolist``; no Python loop over
    rows), then writes with fbgemm's C++ kernel where it takes the dtypes (``_fbgemm_cpu``),
    else row-wise: each output row's values are one contiguous slice of the input, so one
    ``torch.cat(out=)`` of the permuted slices writes the whole output."""
    T = rows.shape[0]
    order = permute.tolist()
    if order and (min(order) < 0 or max(order) >= T):
        _raise_out_of_range(permute, T)
    if rows.numel() and int(rows.min()) < 0:
        _raise_negative_lengths(rows)
    row_sums = rows.sum(dim=1, dtype=torch.int64).tolist()
    in_total, out_total = sum(row_sums), sum(map(row_sums.__getitem__, order))
    if out_total != n:
        _fail(ValueError, f"permuted_lengths_sum={n} but the permuted lengths sum to {out_total}")
    if in_total > values.numel():
        _fail(ValueError, f"lengths sum to {in_total} but values has {values.numel()}")
    fbgemm = _fbgemm_cpu(values, weights)
    if fbgemm is not None:
        fbgemm(permute.to(torch.int32), rows, values, weights, n, rows_out, values_out, weights_out)
        return
    torch.index_select(rows, 0, permute, out=rows_out)
    for src, dst in ((values, values_out), (weights, weights_out)):
        if src is not None and order:
            slices = src.narrow(0, 0, in_total).split(row_sums)
            torch.cat([slices[p] for p in order], out=dst)


# The dtypes fbgemm's CPU permute takes (fbgemm_gpu 1.8, 1.9).
_FBGEMM_VALUES = frozenset((torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16))
_FBGEMM_WEIGHTS = frozenset((torch.float32, torch.float64, torch.float16))


def _fbgemm_cpu(values: torch.Tensor, weights: torch.Tensor | None):
    """fbgemm's ``permute_2D_sparse_preallocated_out`` (fbgemm_gpu >= 1.8) if fbgemm_gpu is
    loaded (recpipe never imports it) and takes these dtypes; else None. Its results are
    fbgemm's own, bit for bit; it checks nothing, so ``_permute_cpu`` checks first."""
    if "fbgemm_gpu" not in sys.modules or values.dtype not in _FBGEMM_VALUES:
        return None
    if weights is not None and weights.dtype not in _FBGEMM_WEIGHTS:
        return None
    return _fbgemm_preallocated_out()


@functools.cache
def _fbgemm_preallocated_out():
    return getattr(torch.ops.fbgemm, "permute_2D_sparse_preallocated_out", None)


def _permute_cuda(
    permute: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    rows_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> None:
    """Triton; no host sync. Bad input fails a device-side assert, never writes garbage.

    Host cost: one allocation and two Triton launches (``permute_triton.permute_into``, through
    cached launchers), then ``torch._assert_async`` on the status: one more small ATen launch,
    a few microseconds of host time. It cannot be folded into the copy kernel at no cost:
    ``tl.device_assert`` is compiled only into kernels built with ``debug=True`` (which also
    adds overflow checks to their int32 arithmetic), and an inline-asm trap would fail without
    naming the op (recent torch prints ``_STATUS_MESSAGE`` with the device assert).
    """
    if permute.numel() == 0 and n != 0:
        _fail(ValueError, f"permuted_lengths_sum={n} but the permuted lengths sum to 0")
    status = permute_triton.permute_into(
        permute, rows, values, weights, n, rows_out, values_out, weights_out
    )
    if status is not None:
        torch._assert_async(status, _STATUS_MESSAGE)


_KERNELS = {"cpu": _permute_cpu, "cuda": _permute_cuda}


def _write(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    fronts: PermuteResult,
) -> None:
    """The device kernel, writing the results into ``fronts`` (see ``_fronts``)."""
    lo, vo, wo = fronts
    kernel = _KERNELS[lengths.device.type]
    kernel(permute, _as_rows(lengths), values, weights, n, _as_rows(lo), vo, wo)


def _into(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> None:
    """The primitive's kernel on every device: the device kernel on the buffers' fronts."""
    _write_fronts(permute, lengths, values, weights, n, (lengths_out, values_out, weights_out))


def _write_fronts(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    outs: Sequence[torch.Tensor | None],
) -> PermuteResult:
    """The device kernel into the fronts of ``outs`` (lengths, values, weights); returns them."""
    fronts = _fronts(outs, _out_shape(permute, lengths), n)
    _write(permute, lengths, values, weights, n, fronts)
    return fronts


@torch.library.custom_op(
    "recpipe::_permute_2D_sparse_data_into",
    mutates_args=("lengths_out", "values_out", "weights_out"),
)
def _into_op(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> None:
    """Write the permute into the front of the buffers (checked by the public op)."""
    raise NotImplementedError(f"{_OP}: no kernel for device {lengths.device}")


for _device in _KERNELS:
    _into_op.register_kernel(_device, _into)


@_into_op.register_fake
def _into_fake(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> None:
    return None


# --- primitive 3: the differentiable permute into new tensors -----------------------------------


def _permute_new(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
) -> PermuteResult:
    outs = _outputs(_out_shape(permute, lengths), n, lengths, values, weights)
    _into(permute, lengths, values, weights, n, *outs)
    return tuple(outs)


_new_op = torch.library.custom_op(
    "recpipe::_permute_2D_sparse_data_functional",
    _permute_new,
    mutates_args=(),
    device_types=tuple(_KERNELS),
    schema="(Tensor permute, Tensor lengths, Tensor values, Tensor? weights, SymInt n) "
    "-> (Tensor, Tensor, Tensor?)",
)


@_new_op.register_fake
def _(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: torch.SymInt,
) -> PermuteResult:
    return tuple(_outputs(_out_shape(permute, lengths), n, lengths, values, weights))


def _source_positions(permute: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """The position in ``values`` of each of the ``n`` permuted values (int64 ``[n]``)."""
    row_sums = _as_rows(lengths).sum(dim=1, dtype=torch.int64)
    out_lengths = row_sums.index_select(0, permute)
    in_starts = (row_sums.cumsum(0) - row_sums).index_select(0, permute)
    shift = in_starts - (out_lengths.cumsum(0) - out_lengths)
    positions = torch.repeat_interleave(shift, out_lengths, output_size=n)
    return positions + torch.arange(n, device=positions.device)


def _setup_backward(ctx, inputs: tuple, output: PermuteResult) -> None:
    permute, lengths, values, _, n = inputs
    ctx.save_for_backward(permute, lengths)
    ctx.numel, ctx.n = values.numel(), n


def _backward(
    ctx, lengths_grad: torch.Tensor, values_grad: torch.Tensor, weights_grad: torch.Tensor | None
) -> tuple:
    """The inverse scatter: each input value gets the sum of its copies' gradients (0 when its
    row is dropped). For a permutation of the rows, fbgemm's backward (its inverse permute)."""
    permute, lengths = ctx.saved_tensors
    positions = _source_positions(permute, lengths, ctx.n)
    _, _, need_values, need_weights, _ = ctx.needs_input_grad
    values_grad, weights_grad = (
        grad.new_zeros(ctx.numel).index_add_(0, positions, grad) if need else None
        for grad, need in ((values_grad, need_values), (weights_grad, need_weights))
    )
    return None, None, values_grad, weights_grad, None


_new_op.register_autograd(_backward, setup_context=_setup_backward)


# --- the public op ------------------------------------------------------------------------------


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True outside tracing, modes and tensor subclasses: the kernels may be called directly."""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._is_torch_function_mode_enabled()
        and _get_current_dispatch_mode() is None
        and all(t is None or type(t) is torch.Tensor for t in tensors)
        and tensors[1].device.type in _KERNELS
    )


def permute_2D_sparse_data(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
    permuted_lengths_out: torch.Tensor | None = None,
    permuted_indices_out: torch.Tensor | None = None,
    permuted_weights_out: torch.Tensor | None = None,
) -> PermuteResult:
    """Permute rows of jagged sparse data, optionally into preallocated buffers.

    Args:
        permute: ``[T']`` int32/int64, output row ``t'`` is input row ``permute[t']`` (in
            ``[0, T)``; rows may repeat or be left out).
        lengths: ``[T, B]`` (or ``[T]``) int32/int64 segment lengths (``>= 0``), row-major over
            ``values``.
        values: ``[N]`` the jagged values (any dtype), ``N >= lengths.sum()``.
        weights: optional ``[N]`` per-value weights (any floating dtype).
        permuted_lengths_sum: the number of permuted values if known on the host. When given
            (or with CUDA inputs generally, once it is known), the op never syncs the device.
            When ``None`` it is computed with one device sync.
        permuted_lengths_out, permuted_indices_out, permuted_weights_out: optional contiguous
            buffers of the output dtype and device, at least ``T' * B`` / ``n`` / ``n``
            elements. The result is written into their front; the returned tensors share
            their storage (the buffer itself when its shape is exact, else a view).

    Returns:
        ``(permuted_lengths [T', B] or [T'], permuted_values [n], permuted_weights [n] | None)``.

    Errors: bad metadata raises on the host. Bad data (a permute index out of range, a negative
    length, a wrong ``permuted_lengths_sum``, lengths summing to more than ``N``) raises on CPU;
    on CUDA it fails a device-side assert, except that an index out of range or a negative
    length raise on the host when ``permuted_lengths_sum`` is ``None`` (that call syncs anyway).

    Autograd: ``weights`` and floating ``values`` that require grad get gradients (each input
    value the sum of its copies' gradients, 0 for a dropped row: fbgemm's for a permutation);
    the outputs are then new tensors: preallocated buffers raise a ``ValueError``.

    Streams: all work is queued on the current stream. The caller owns the buffers and must order
    their allocation and later reads against this stream (see recpipe.kjt / recpipe.pipeline).

    Eager calls on plain tensors run the kernels directly (the dispatcher's Python layers cost
    more host time than the kernels' launches); anything else goes through
    ``torch.ops.recpipe.permute_2D_sparse_data``, with the same checks and results.
    """
    args = (
        permute,
        lengths,
        values,
        weights,
        permuted_lengths_sum,
        permuted_lengths_out,
        permuted_indices_out,
        permuted_weights_out,
    )
    if _plain_eager(permute, lengths, values, weights, *args[5:]):
        return _permute(*args, direct=True)
    return torch.ops.recpipe.permute_2D_sparse_data(*args)


def permute_into(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> PermuteResult:
    """``permute_2D_sparse_data(permute, lengths, values, weights, n, lengths_out, values_out,
    weights_out)`` without the op's checks of the arguments' metadata, for callers that made
    the buffers from the same inputs (``recpipe.kjt``): its Python costs about as much host
    time as the kernels, once per sharded module per step.

    Under tracing, a mode (``TORCH_CUDA_SANITIZER``'s) or tensor subclasses it is the op itself,
    checks included. Contract (unchecked): no autograd; ``lengths`` 1D or 2D; the buffers
    contiguous, of the inputs' dtypes and device, with at least ``T' * B``, ``n`` and ``n``
    elements (``weights_out`` given exactly when ``weights`` is). The data checks are the op's:
    on CPU a bad permute index, a negative length or a wrong ``n`` raises, on CUDA it fails a
    device-side assert. Returns the results in the front of the buffers, as the op does.
    """
    outs = (lengths_out, values_out, weights_out)
    if not _plain_eager(permute, lengths, values, weights, *outs):  # e.g. the CUDA sanitizer's
        # dispatch mode: through the op, which declares what it writes
        return torch.ops.recpipe.permute_2D_sparse_data(permute, lengths, values, weights, n, *outs)
    permute, lengths, values = permute.contiguous(), lengths.contiguous(), values.contiguous()
    weights = None if weights is None else weights.contiguous()
    return _write_fronts(permute, lengths, values, weights, n, outs)


def _permute(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    permuted_lengths_sum: int | None = None,
    permuted_lengths_out: torch.Tensor | None = None,
    permuted_indices_out: torch.Tensor | None = None,
    permuted_weights_out: torch.Tensor | None = None,
    *,
    direct: bool = False,
) -> PermuteResult:
    """The public op's CompositeImplicitAutograd kernel (see permute_2D_sparse_data).

    ``direct=True`` calls the device kernels instead of the primitives' ops (eager only).
    """
    _check_inputs(permute, lengths, values, weights, permuted_lengths_sum)
    if permuted_weights_out is not None and weights is None:
        _fail(ValueError, "permuted_weights_out given but weights is None")
    given = (permuted_lengths_out, permuted_indices_out, permuted_weights_out)
    n = permuted_lengths_sum
    if n is None:
        n = (_lengths_sum if direct else torch.ops.recpipe._permuted_lengths_sum)(permute, lengths)
        torch._check(n >= 0)
    permute, lengths, values = permute.contiguous(), lengths.contiguous(), values.contiguous()
    weights = None if weights is None else weights.contiguous()
    if torch.is_grad_enabled() and (
        values.requires_grad or (weights is not None and weights.requires_grad)
    ):
        return _differentiable(permute, lengths, values, weights, n, given)
    lengths_shape = _out_shape(permute, lengths)
    outs = _outputs(lengths_shape, n, lengths, values, weights, given)
    if not direct:
        torch.ops.recpipe._permute_2D_sparse_data_into(permute, lengths, values, weights, n, *outs)
        return _fronts(outs, lengths_shape, n)
    return _write_fronts(permute, lengths, values, weights, n, outs)


def _differentiable(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int | torch.SymInt,
    given: Sequence[torch.Tensor | None],
) -> PermuteResult:
    """The permute recorded by autograd, into new tensors (no preallocated outputs)."""
    wants_grad = "weights" if weights is not None and weights.requires_grad else "values"
    for name, buf in zip(_OUT_NAMES, given):
        if buf is not None:
            _fail(ValueError, f"{name} must be None when {wants_grad} requires grad")
    functional = torch.ops.recpipe._permute_2D_sparse_data_functional
    return functional(permute, lengths, values, weights, n)


for _name in ("permute_2D_sparse_data", "permute_sparse_data"):
    _LIB.define(_name + _PUBLIC_SCHEMA)
    _LIB.impl(_name, _permute, "CompositeImplicitAutograd")
