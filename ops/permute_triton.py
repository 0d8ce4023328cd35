"""Triton kernels of ``recpipe::permute_2D_sparse_data`` (the CUDA path).

Row ``t'`` of the output is row ``permute[t']`` of the input: its ``B`` lengths, and the values
(and weights) of those ``B`` segments, which are contiguous in both the input and the output.
So the permute is one contiguous copy per output row, done by ``_copy_kernel`` (grid
``T' x P``). Each program needs its row's source and destination starts, found in one of three
ways, chosen by size (host launch cost matters as much as bandwidth at small sizes):

- one launch (``T' * T * B`` small, e.g. 170 features x batch 128): every program sums the
  lengths of the rows before its own (re-reads from L2), and also permutes the lengths;
- fused (``max(T, T')`` up to a few thousand): ``_lengths_kernel`` permutes the lengths and
  sums every input row, then each copy program sums the row sums before its row;
- offsets (many rows, e.g. 1D lengths of a variable batch): ``_lengths_kernel``, then a
  single-program ``_offsets_kernel`` computes all starts once, then the copy.

Nothing here reads or writes out of bounds or syncs with the host, even on bad input: rows with
an out-of-range permute index are written as empty, copies are clipped to the buffers, and the
status flag is returned for the caller to assert on asynchronously (``torch._assert_async``).
With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (CI tests them that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Copy launch parameters, tuned on an H100 with scripts/tune_permute.py (large shape: BLOCK 1024
# with 16 warps reached 80% of a plain copy's bandwidth; 4096 with 8 warps, 65%).
COPY_BLOCK = 1024
COPY_WARPS = 16
TARGET_PROGRAMS = 2048  # CTAs to aim for: enough to fill 132 SMs several times over
SCAN_BLOCK = 1024
# How the row starts are found (see _copy_kernel's MODE):
_ONE_LAUNCH, _FUSED, _OFFSETS = 0, 1, 2
ONE_LAUNCH_MAX_READS = 1 << 24  # T' * T * B: lengths re-read by all programs (L2-resident)
FUSED_MAX_ROWS = 8192  # max(T, T'): row sums re-read by all programs


# Sizes change every batch: kernels don't specialize on them (== 1, % 16), or a training run
# would recompile them mid-way.
@triton.jit(do_not_specialize=["T", "T_out", "B"])
def _lengths_kernel(
    permute_ptr,
    lengths_ptr,
    lengths_out_ptr,
    row_sums_ptr,
    T,
    T_out,
    B,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_mask = rows < T
    out_mask = rows < T_out
    src = tl.load(permute_ptr + rows, mask=out_mask, other=0).to(tl.int64)
    valid = out_mask & (src >= 0) & (src < T)
    base = rows.to(tl.int64) * B
    src_base = src * B
    in_sum = tl.zeros([BLOCK_R], dtype=tl.int64)
    for b0 in range(0, B, BLOCK_B):
        cols = b0 + tl.arange(0, BLOCK_B)
        col_mask = cols < B
        x = tl.load(
            lengths_ptr + base[:, None] + cols[None, :],
            mask=in_mask[:, None] & col_mask[None, :],
            other=0,
        )
        in_sum += tl.sum(x.to(tl.int64), axis=1)
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
    tl.store(row_sums_ptr + rows, in_sum, mask=in_mask)


@triton.jit
def _sum_rows_before(
    x_ptr, permute_ptr, end, T, W, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr
):
    """Sum of rows ``r < end`` of ``x [T, W]`` (rows ``permute[t]``, ``t < end``, when GATHER),
    and the number of out-of-range permute indices among them (GATHER only)."""
    total = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int64)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    for r0 in range(0, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = r < end
        if GATHER:
            q = tl.load(permute_ptr + r, mask=mask, other=0).to(tl.int64)
            ok = (q >= 0) & (q < T)
            bad += (mask & ~ok).to(tl.int32)
            mask = mask & ok
            r = q
        for w0 in range(0, W, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            m = mask[:, None] & (w < W)[None, :]
            total += tl.load(x_ptr + r.to(tl.int64)[:, None] * W + w[None, :], mask=m, other=0).to(tl.int64)
    return tl.sum(tl.sum(total, axis=1), axis=0), tl.sum(bad, axis=0)


@triton.jit(do_not_specialize=["T", "T_out", "n", "values_numel"])
def _offsets_kernel(
    permute_ptr,
    row_sums_ptr,
    in_excl_ptr,
    src_start_ptr,
    out_start_ptr,
    status_ptr,
    T,
    T_out,
    n,
    values_numel,
    BLOCK: tl.constexpr,
):
    """One program: the starts of every output row, and the status (the many-rows path)."""
    carry = tl.zeros([1], dtype=tl.int64)
    for r0 in range(0, T, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T
        x = tl.load(row_sums_ptr + rows, mask=mask, other=0)
        tl.store(in_excl_ptr + rows, tl.cumsum(x, axis=0) - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    in_total = carry
    tl.debug_barrier()  # the gathers below read starts that other threads stored
    carry = tl.zeros([1], dtype=tl.int64)
    bad = tl.zeros([1], dtype=tl.int32)
    for r0 in range(0, T_out, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T_out
        src = tl.load(permute_ptr + rows, mask=mask, other=0).to(tl.int64)
        valid = mask & (src >= 0) & (src < T)
        bad += tl.sum((mask & ~valid).to(tl.int32), axis=0)
        tl.store(src_start_ptr + rows, tl.load(in_excl_ptr + src, mask=valid, other=0), mask=mask)
        x = tl.load(row_sums_ptr + src, mask=valid, other=0)
        tl.store(out_start_ptr + rows, tl.cumsum(x, axis=0) - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    ok = (bad == 0) & (carry == n) & (in_total <= values_numel)
    tl.store(status_ptr + tl.arange(0, 1), ok.to(tl.int64))


@triton.jit(do_not_specialize=["T", "T_out", "W", "n", "values_numel"])
def _copy_kernel(
    permute_ptr,
    sums_ptr,
    src_start_ptr,
    out_start_ptr,
    status_ptr,
    lengths_out_ptr,
    values_ptr,
    weights_ptr,
    values_out_ptr,
    weights_out_ptr,
    T,
    T_out,
    W,
    n,
    values_numel,
    MODE: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Copy output row ``program_id(0)``'s values (and weights), ``num_programs(1)`` programs
    a row. ``sums [T, W]`` holds what sums to the row lengths: the lengths themselves
    (MODE == 0, W == B: this kernel also permutes the lengths, a one-launch op) or the row
    sums (MODE 1 and 2, W == 1). MODE 0 and 1 find the row starts by summing the rows before;
    MODE 2 loads them from ``src_start`` / ``out_start`` (``_offsets_kernel``)."""
    row = tl.program_id(0)
    src_row = tl.load(permute_ptr + row).to(tl.int64)
    valid = (src_row >= 0) & (src_row < T)
    safe_row = tl.where(valid, src_row, 0)
    w = tl.arange(0, BLOCK_W)
    valid_w = tl.where(valid, W, 0)  # an invalid row reads nothing and is written as empty
    length = tl.zeros([BLOCK_W], dtype=tl.int64)
    for w0 in range(0, W, BLOCK_W):
        m = w0 + w < valid_w
        x = tl.load(sums_ptr + safe_row * W + w0 + w, mask=m, other=0)
        length += x.to(tl.int64)
        if MODE == 0:
            if tl.program_id(1) == 0:
                tl.store(lengths_out_ptr + row.to(tl.int64) * W + w0 + w, x, mask=w0 + w < W)
    length = tl.sum(length, axis=0)
    if MODE == 2:
        src = tl.load(src_start_ptr + row)
        dst = tl.load(out_start_ptr + row)
    else:
        src, _ = _sum_rows_before(sums_ptr, permute_ptr, safe_row, T, W, False, BLOCK_R, BLOCK_W)
        dst, bad = _sum_rows_before(sums_ptr, permute_ptr, row, T, W, True, BLOCK_R, BLOCK_W)
        if (row == T_out - 1) & (tl.program_id(1) == 0):
            in_total, _ = _sum_rows_before(sums_ptr, permute_ptr, T, T, W, False, BLOCK_R, BLOCK_W)
            ok = valid & (bad == 0) & (dst + length == n) & (in_total <= values_numel)
            tl.store(status_ptr, ok.to(tl.int64))
    # Clip to the buffers so that inconsistent input (flagged in the status) never touches
    # memory out of bounds.
    length = tl.minimum(length, tl.maximum(tl.minimum(n - dst, values_numel - src), 0))
    for k in range(tl.program_id(1) * BLOCK, length, tl.num_programs(1) * BLOCK):
        idx = k + tl.arange(0, BLOCK)
        mask = idx < length
        tl.store(values_out_ptr + dst + idx, tl.load(values_ptr + src + idx, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            wt = tl.load(weights_ptr + src + idx, mask=mask)
            tl.store(weights_out_ptr + dst + idx, wt, mask=mask)


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
    at least ``n``. Launches on the current stream; never syncs. Returns a one-element int64
    status tensor: 1 if every permute index is in ``[0, T)``, the permuted lengths sum to ``n``
    and the input lengths sum to at most ``values.numel()``; 0 otherwise. Returns ``None`` when
    ``T' == 0`` (nothing to check: ``n`` must then be 0, which the caller knows on the host).
    """
    T, B = lengths.shape
    T_out = permute.numel()
    if T_out == 0:
        return None
    mode = _ONE_LAUNCH if T_out * T * B <= ONE_LAUNCH_MAX_READS else (
        _FUSED if max(T, T_out) <= FUSED_MAX_ROWS else _OFFSETS
    )
    scratch = {_ONE_LAUNCH: 1, _FUSED: T + 1, _OFFSETS: 2 * T + 2 * T_out + 1}[mode]
    work = torch.empty(scratch, dtype=torch.int64, device=lengths.device)
    status, row_sums, rest = work[:1], work[1 : T + 1], work[T + 1 :]
    in_excl, src_start, out_start = rest.split([T, T_out, T_out]) if mode == _OFFSETS else (rest,) * 3
    if mode != _ONE_LAUNCH:
        block_b = min(triton.next_power_of_2(max(B, 1)), 256)
        block_r = max(1, 1024 // block_b)
        _lengths_kernel[(triton.cdiv(max(T, T_out), block_r),)](
            permute, lengths, lengths_out, row_sums, T, T_out, B, BLOCK_R=block_r, BLOCK_B=block_b
        )
    if mode == _OFFSETS:
        _offsets_kernel[(1,)](
            permute, row_sums, in_excl, src_start, out_start, status,
            T, T_out, n, values.numel(), BLOCK=SCAN_BLOCK,
        )
    sums, W = (lengths, B) if mode == _ONE_LAUNCH else (row_sums, 1)
    block_w = min(triton.next_power_of_2(max(W, 1)), 256)
    per_row = triton.cdiv(triton.cdiv(max(n, 1), T_out), COPY_BLOCK)
    programs_per_row = max(1, min(per_row, triton.cdiv(TARGET_PROGRAMS, T_out), 65535))
    if mode == _ONE_LAUNCH:  # every program re-reads the lengths before its row: bound the reads
        programs_per_row = min(programs_per_row, max(1, ONE_LAUNCH_MAX_READS // max(1, T_out * T * B)))
    _copy_kernel[(T_out, programs_per_row)](
        permute, sums, src_start, out_start, status, lengths_out,
        values,
        values if weights is None else weights,
        values_out,
        values_out if weights_out is None else weights_out,
        T, T_out, W, n, values.numel(),
        MODE=mode, HAS_WEIGHTS=weights is not None, BLOCK=COPY_BLOCK,
        BLOCK_R=max(1, SCAN_BLOCK // block_w), BLOCK_W=block_w, num_warps=COPY_WARPS,
    )
    return status
