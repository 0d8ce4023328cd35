"""Triton kernels of ``recpipe::permute_2D_sparse_data`` (the CUDA path).

Row ``t'`` of the output is row ``permute[t']`` of the input: its ``B`` lengths, and the values
(and weights) of those ``B`` segments, which are contiguous in both the input and the output.
So the permute is one contiguous copy per output row:

1. ``_lengths_kernel`` (grid over rows): the permuted lengths, and the sum of every input row.
2. ``_copy_kernel`` (grid ``T' x P``): each program finds its row's source and destination start
   by summing the row sums before it (``T + T'`` loads from L2: cheap for the usual few
   thousand features), then copies its share of the row's values and weights. The program of
   the last row also writes the status flag.
   With many rows (``max(T, T') > FUSED_MAX_ROWS``, e.g. 1D lengths of a variable batch) a
   single-program ``_offsets_kernel`` computes the starts and the status once instead.

(A one-launch variant, where every copy program re-reads the raw lengths, saves host time but
costs more GPU time, so it is not used: docs/results/permute-triton-tuning_1xH100_2026-11-23.md.)

Nothing here reads or writes out of bounds or syncs with the host, even on bad input: rows with
an out-of-range permute index or a negative length are copied as empty, copies are clipped to the
buffers, and the status flag is returned for the caller to assert on asynchronously
(``torch._assert_async``). The kernels share one int64 work buffer (one allocation, see
``_work``). After a kernel's first launch, later launches skip Triton's JIT dispatch
(``_launch``). With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (CI tests them
that way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

# Copy launch parameters (BLOCK, num_warps) for long and short rows, tuned with
# scripts/tune_permute.py (docs/results/permute-triton-tuning_1xH100_2026-11-23.md).
COPY_LONG_ROWS = (1024, 16)
COPY_SHORT_ROWS = (2048, 8)
LONG_ROW = 32768
TARGET_PROGRAMS = 2048  # CTAs to aim for: enough to fill 132 SMs several times over
SCAN_BLOCK = 1024
FUSED_MAX_ROWS = 8192  # max(T, T'): row sums re-read by every copy program


@triton.jit
def _work(work_ptr, T, T_out):
    """Pointers into the int64 work buffer ``[status | row_sums T | in_excl T | src_start T' |
    out_start T']`` (the last three only without FUSED). A row sum is -1 where the row holds a
    negative length: readers count it as bad and copy the row as empty."""
    row_sums_ptr = work_ptr + 1
    src_start_ptr = row_sums_ptr + 2 * T
    return work_ptr, row_sums_ptr, row_sums_ptr + T, src_start_ptr, src_start_ptr + T_out


# Sizes change every batch: kernels don't specialize on them (== 1, % 16), or a training run
# would recompile them mid-way.
@triton.jit(do_not_specialize=["T", "T_out", "B"])
def _lengths_kernel(
    permute_ptr,
    lengths_ptr,
    lengths_out_ptr,
    work_ptr,
    T,
    T_out,
    B,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    _, row_sums_ptr, _, _, _ = _work(work_ptr, T, T_out)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_mask = rows < T
    out_mask = rows < T_out
    src = tl.load(permute_ptr + rows, mask=out_mask, other=0).to(tl.int64)
    valid = out_mask & (src >= 0) & (src < T)
    base = rows.to(tl.int64) * B
    src_base = src * B
    in_sum = tl.zeros([BLOCK_R], dtype=tl.int64)
    negative = tl.zeros([BLOCK_R], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        cols = b0 + tl.arange(0, BLOCK_B)
        col_mask = cols < B
        x = tl.load(
            lengths_ptr + base[:, None] + cols[None, :],
            mask=in_mask[:, None] & col_mask[None, :],
            other=0,
        )
        in_sum += tl.sum(x.to(tl.int64), axis=1)
        negative += tl.sum((x < 0).to(tl.int32), axis=1)
        y = tl.load(
            lengths_ptr + src_base[:, None] + cols[None, :],
            mask=valid[:, None] & col_mask[None, :],
            other=0,
        )
        tl.store(
            lengths_out_ptr + base[:, None] + cols[None, :],
            y,
            mask=out_mask[:, None] & col_mask[None, :],
        )
    tl.store(row_sums_ptr + rows, tl.where(negative > 0, -1, in_sum), mask=in_mask)


@triton.jit
def _sum_rows_before(row_sums_ptr, permute_ptr, end, T, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """sum(row_sums[r] for r < end), or over rows ``permute[t]`` for ``t < end`` when GATHER;
    and the number of bad rows among them: a negative length, or (GATHER) an out-of-range
    permute index. Bad rows count as empty."""
    total = tl.zeros([BLOCK], dtype=tl.int64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for r0 in range(0, end, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        mask = r < end
        if GATHER:
            q = tl.load(permute_ptr + r, mask=mask, other=0).to(tl.int64)
            ok = (q >= 0) & (q < T)
            bad += (mask & ~ok).to(tl.int32)
            mask = mask & ok
            r = q
        x = tl.load(row_sums_ptr + r, mask=mask, other=0)
        bad += (x < 0).to(tl.int32)
        total += tl.maximum(x, 0)
    return tl.sum(total, axis=0), tl.sum(bad, axis=0)


@triton.jit(do_not_specialize=["T", "T_out", "n", "values_numel"])
def _offsets_kernel(
    permute_ptr,
    work_ptr,
    T,
    T_out,
    n,
    values_numel,
    BLOCK: tl.constexpr,
):
    """One program: the starts of every output row, and the status (the many-rows path)."""
    status_ptr, row_sums_ptr, in_excl_ptr, src_start_ptr, out_start_ptr = _work(work_ptr, T, T_out)
    carry = tl.zeros([1], dtype=tl.int64)
    bad = tl.zeros([1], dtype=tl.int32)
    for r0 in range(0, T, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T
        x = tl.load(row_sums_ptr + rows, mask=mask, other=0)
        bad += tl.sum((x < 0).to(tl.int32), axis=0)
        x = tl.maximum(x, 0)
        tl.store(in_excl_ptr + rows, tl.cumsum(x, axis=0) - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    in_total = carry
    tl.debug_barrier()  # the gathers below read starts that other threads stored
    carry = tl.zeros([1], dtype=tl.int64)
    for r0 in range(0, T_out, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T_out
        src = tl.load(permute_ptr + rows, mask=mask, other=0).to(tl.int64)
        valid = mask & (src >= 0) & (src < T)
        bad += tl.sum((mask & ~valid).to(tl.int32), axis=0)
        tl.store(src_start_ptr + rows, tl.load(in_excl_ptr + src, mask=valid, other=0), mask=mask)
        x = tl.maximum(tl.load(row_sums_ptr + src, mask=valid, other=0), 0)
        tl.store(out_start_ptr + rows, tl.cumsum(x, axis=0) - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    ok = (bad == 0) & (carry == n) & (in_total <= values_numel)
    tl.store(status_ptr + tl.arange(0, 1), ok.to(tl.int64))


@triton.jit(do_not_specialize=["T", "T_out", "n", "values_numel"])
def _copy_kernel(
    permute_ptr,
    work_ptr,
    values_ptr,
    weights_ptr,
    values_out_ptr,
    weights_out_ptr,
    T,
    T_out,
    n,
    values_numel,
    FUSED: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
):
    """Copy output row ``program_id(0)``'s values (and weights), ``num_programs(1)`` programs a
    row. FUSED: find the row starts by summing the row sums before the row (and the last row's
    program writes the status); else load them from ``_offsets_kernel``'s output."""
    status_ptr, row_sums_ptr, _, src_start_ptr, out_start_ptr = _work(work_ptr, T, T_out)
    row = tl.program_id(0)
    src_row = tl.load(permute_ptr + row).to(tl.int64)
    valid = (src_row >= 0) & (src_row < T)
    safe_row = tl.where(valid, src_row, 0)
    length = tl.maximum(tl.load(row_sums_ptr + safe_row, mask=valid, other=0), 0)
    if FUSED:
        src, _ = _sum_rows_before(row_sums_ptr, permute_ptr, safe_row, T, False, SCAN_BLOCK)
        dst, bad = _sum_rows_before(row_sums_ptr, permute_ptr, row, T, True, SCAN_BLOCK)
        if (row == T_out - 1) & (tl.program_id(1) == 0):
            in_total, bad_in = _sum_rows_before(row_sums_ptr, permute_ptr, T, T, False, SCAN_BLOCK)
            ok = valid & (bad == 0) & (bad_in == 0)
            ok = ok & (dst + length == n) & (in_total <= values_numel)
            tl.store(status_ptr, ok.to(tl.int64))
    else:
        src = tl.load(src_start_ptr + row)
        dst = tl.load(out_start_ptr + row)
    # Clip to the buffers so that inconsistent input (flagged in the status) never touches
    # memory out of bounds (src and dst are sums of non-negative row sums).
    length = tl.minimum(length, tl.maximum(tl.minimum(n - dst, values_numel - src), 0))
    for k in range(tl.program_id(1) * BLOCK, length, tl.num_programs(1) * BLOCK):
        idx = k + tl.arange(0, BLOCK)
        mask = idx < length
        tl.store(values_out_ptr + dst + idx, tl.load(values_ptr + src + idx, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + src + idx, mask=mask)
            tl.store(weights_out_ptr + dst + idx, w, mask=mask)


# --- launching ----------------------------------------------------------------------------------

# Kernels launched before, by everything Triton specializes them on (see _launch).
_COMPILED: dict[tuple, CompiledKernel] = {}


def _launch(
    kernel: triton.runtime.JITFunction,
    grid: tuple[int, int, int],
    device: tuple[int, int] | None,
    pointers: Sequence[torch.Tensor],
    sizes: Sequence[int],
    constexprs: Sequence[object],
    num_warps: int,
) -> None:
    """``kernel[grid](*pointers, *sizes, *constexprs, num_warps=num_warps)``, the parameters in
    this order, without Triton's JIT dispatch after the first launch.

    ``JITFunction.run`` binds the arguments, computes their specialization and looks up its
    caches on every call, host time on every launch. Here the ``CompiledKernel`` that a JIT launch
    returns is kept under a key holding everything Triton specializes on: the device, each
    pointer's dtype and 16-byte alignment (inputs may be views at any offset), each size's
    integer type and its ``== 1`` and ``% 16`` (ignored by Triton for ``do_not_specialize``
    sizes: they only split the cache), the constexprs and ``num_warps``. Later launches go
    through ``CompiledKernel[grid](*args, stream=...)``, whose launcher takes every parameter
    in order (triton >= 3.2). ``device`` is ``(current device, its current raw stream)``, or
    ``None`` for CPU tensors (``TRITON_INTERPRET=1``: always the JIT launch).
    """
    args = (*pointers, *sizes, *constexprs)
    if device is None:
        kernel[grid](*args, num_warps=num_warps)
        return
    key = (
        kernel,
        device[0],
        num_warps,
        *constexprs,
        *[(t.dtype, t.data_ptr() % 16 == 0) for t in pointers],
        *[(s == 1, s % 16 == 0, -(2**31) <= s < 2**31) for s in sizes],
    )
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[grid](*args, stream=device[1])
        return
    compiled = kernel[grid](*args, num_warps=num_warps)
    if isinstance(compiled, CompiledKernel) and len(compiled.src.signature) == len(args):
        _COMPILED[key] = compiled


def permute_into(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> torch.Tensor | None:
    """Permute ``lengths [T, B]`` rows into ``lengths_out`` and their data into the outputs.

    Contract (checked by the caller, ``recpipe.ops.permute``): all tensors on one device and
    contiguous; ``lengths_out`` holds ``T' * B`` elements, ``values_out`` and ``weights_out``
    at least ``n``. Launches on the current stream; never syncs. Returns a 0-dim int64 status
    tensor: 1 if every permute index is in ``[0, T)``, no length is negative, the permuted
    lengths sum to ``n`` and the input lengths sum to at most ``values.numel()``; 0 otherwise.
    Returns ``None`` when ``T' == 0``: nothing is read or written, so nothing is checked (``n``
    must then be 0, which the caller knows on the host).

    Host cost: one allocation (the work buffer) and two launches (three with many rows).
    """
    T, B = lengths.shape
    T_out = permute.numel()
    if T_out == 0:
        return None
    fused = max(T, T_out) <= FUSED_MAX_ROWS
    work_numel = 1 + T if fused else 1 + 2 * (T + T_out)
    work = torch.empty(work_numel, dtype=torch.int64, device=lengths.device)
    device = None
    if lengths.is_cuda:
        index = torch.cuda.current_device()  # Triton launches on the current device and stream
        device = (index, torch._C._cuda_getCurrentRawStream(index))
    block_b = min(triton.next_power_of_2(max(B, 1)), 256)
    block_r = max(1, 1024 // block_b)
    _launch(
        _lengths_kernel, (triton.cdiv(max(T, T_out), block_r), 1, 1), device,
        (permute, lengths, lengths_out, work), (T, T_out, B), (block_r, block_b), 4,
    )
    numel = values.numel()
    if not fused:
        _launch(
            _offsets_kernel, (1, 1, 1), device,
            (permute, work), (T, T_out, n, numel), (SCAN_BLOCK,), 4,
        )
    row_len = triton.cdiv(max(n, 1), T_out)
    block, warps = COPY_LONG_ROWS if row_len >= LONG_ROW else COPY_SHORT_ROWS
    programs_per_row = max(
        1, min(triton.cdiv(row_len, block), triton.cdiv(TARGET_PROGRAMS, T_out), 65535)
    )
    has_weights = weights is not None
    _launch(
        _copy_kernel, (T_out, programs_per_row, 1), device,
        (
            permute, work, values, weights if has_weights else values,
            values_out, weights_out if has_weights else values_out,
        ),
        (T, T_out, n, numel), (fused, has_weights, block, SCAN_BLOCK), warps,
    )
    return work[0]
