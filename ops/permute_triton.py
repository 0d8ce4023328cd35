"""Triton kernels of ``recpipe::permute_2D_sparse_data`` (the CUDA path).

Row ``t'`` of the output is row ``permute[t']`` of the input: its ``B`` lengths, and the values
(and weights) of those ``B`` segments, which are contiguous in both the input and the output.
So the permute is one contiguous copy per output row, and three launches do it all:

1. ``_lengths_kernel``  (grid over rows): permuted lengths, per-row sums of input and output.
2. ``_offsets_kernel``  (one program): exclusive prefix sums of both row sums, the source start
   of every output row, and a status flag (permute in range, sizes consistent).
3. ``_copy_kernel``     (grid ``T' x P``): copies values and weights row by row.

Nothing here reads memory out of bounds or syncs with the host, even on bad input: rows with an
out-of-range permute index are written as empty, copies are clipped to the buffers, and the
status flag is returned for the caller to assert on asynchronously (``torch._assert_async``).
With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (CI tests them that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COPY_BLOCK = 4096
_COPY_WARPS = 8
_TARGET_PROGRAMS = 2048  # enough CTAs to fill 132 SMs several times over
_SCAN_BLOCK = 1024


@triton.jit
def _lengths_kernel(
    permute_ptr,
    lengths_ptr,
    lengths_out_ptr,
    row_sums_ptr,
    out_row_sums_ptr,
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
    in_base = rows.to(tl.int64) * B
    src_base = src * B
    out_base = rows.to(tl.int64) * B
    in_sum = tl.zeros([BLOCK_R], dtype=tl.int64)
    out_sum = tl.zeros([BLOCK_R], dtype=tl.int64)
    for b0 in range(0, B, BLOCK_B):
        cols = b0 + tl.arange(0, BLOCK_B)
        col_mask = cols < B
        x = tl.load(
            lengths_ptr + in_base[:, None] + cols[None, :],
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
            lengths_out_ptr + out_base[:, None] + cols[None, :],
            y,
            mask=out_mask[:, None] & col_mask[None, :],
        )
        out_sum += tl.sum(y.to(tl.int64), axis=1)
    tl.store(row_sums_ptr + rows, in_sum, mask=in_mask)
    tl.store(out_row_sums_ptr + rows, out_sum, mask=out_mask)


@triton.jit
def _offsets_kernel(
    permute_ptr,
    row_sums_ptr,
    out_row_sums_ptr,
    src_start_ptr,
    out_start_ptr,
    status_ptr,
    T,
    T_out,
    n,
    values_numel,
    BLOCK: tl.constexpr,
):
    # Exclusive prefix sum of the input row sums, in place.
    carry = tl.zeros([1], dtype=tl.int64)
    for r0 in range(0, T, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T
        x = tl.load(row_sums_ptr + rows, mask=mask, other=0)
        incl = tl.cumsum(x, axis=0)
        tl.store(row_sums_ptr + rows, incl - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    in_total = carry
    tl.debug_barrier()  # the gathers below read starts that other threads stored
    carry = tl.zeros([1], dtype=tl.int64)
    bad = tl.zeros([1], dtype=tl.int32)
    for r0 in range(0, T_out, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        mask = rows < T_out
        src = tl.load(permute_ptr + rows, mask=mask, other=0).to(tl.int64)
        valid = (src >= 0) & (src < T)
        bad += tl.sum((mask & ~valid).to(tl.int32), axis=0)
        start = tl.load(row_sums_ptr + src, mask=mask & valid, other=0)
        tl.store(src_start_ptr + rows, start, mask=mask)
        x = tl.load(out_row_sums_ptr + rows, mask=mask, other=0)
        incl = tl.cumsum(x, axis=0)
        tl.store(out_start_ptr + rows, incl - x + carry, mask=mask)
        carry += tl.sum(x, axis=0)
    ok = (bad == 0) & (carry == n) & (in_total <= values_numel)
    tl.store(status_ptr + tl.arange(0, 1), ok.to(tl.int64))


@triton.jit
def _copy_kernel(
    values_ptr,
    weights_ptr,
    values_out_ptr,
    weights_out_ptr,
    src_start_ptr,
    out_start_ptr,
    out_row_sums_ptr,
    n,
    values_numel,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    step = tl.num_programs(1) * BLOCK
    src = tl.load(src_start_ptr + row)
    dst = tl.load(out_start_ptr + row)
    length = tl.load(out_row_sums_ptr + row)
    # Clip to the buffers so that inconsistent input (flagged in the status) never touches
    # memory out of bounds.
    length = tl.minimum(length, tl.maximum(tl.minimum(n - dst, values_numel - src), 0))
    for k in range(tl.program_id(1) * BLOCK, length, step):
        idx = k + tl.arange(0, BLOCK)
        mask = idx < length
        tl.store(values_out_ptr + dst + idx, tl.load(values_ptr + src + idx, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + src + idx, mask=mask)
            tl.store(weights_out_ptr + dst + idx, w, mask=mask)


def permute_into(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n: int,
    lengths_out: torch.Tensor,
    values_out: torch.Tensor,
    weights_out: torch.Tensor | None,
) -> torch.Tensor:
    """Permute ``lengths [T, B]`` rows into ``lengths_out`` and their data into the outputs.

    Contract (checked by the caller, ``recpipe.ops.permute``): all tensors on one device and
    contiguous; ``lengths_out`` holds ``T' * B`` elements, ``values_out`` and ``weights_out``
    at least ``n``. Launches on the current stream; never syncs. Returns a one-element int64
    status tensor: 1 if every permute index is in ``[0, T)``, the permuted lengths sum to ``n``
    and the input lengths sum to at most ``values.numel()``; 0 otherwise.
    """
    T, B = lengths.shape
    T_out = permute.numel()
    device = lengths.device
    work = torch.empty(T + 3 * T_out + 1, dtype=torch.int64, device=device)
    row_sums, out_row_sums, src_start, out_start, status = torch.split(
        work, [T, T_out, T_out, T_out, 1]
    )
    rows = max(T, T_out)
    if rows:
        block_b = min(triton.next_power_of_2(max(B, 1)), 256)
        block_r = max(1, 1024 // block_b)
        _lengths_kernel[(triton.cdiv(rows, block_r),)](
            permute, lengths, lengths_out, row_sums, out_row_sums, T, T_out, B,
            BLOCK_R=block_r, BLOCK_B=block_b,
        )
    _offsets_kernel[(1,)](
        permute, row_sums, out_row_sums, src_start, out_start, status,
        T, T_out, n, values.numel(), BLOCK=_SCAN_BLOCK,
    )
    if T_out and n:
        per_row = triton.cdiv(triton.cdiv(n, T_out), _COPY_BLOCK)
        programs_per_row = max(1, min(per_row, triton.cdiv(_TARGET_PROGRAMS, T_out)))
        _copy_kernel[(T_out, programs_per_row)](
            values,
            values if weights is None else weights,
            values_out,
            values_out if weights_out is None else weights_out,
            src_start, out_start, out_row_sums, n, values.numel(),
            HAS_WEIGHTS=weights is not None, BLOCK=_COPY_BLOCK, num_warps=_COPY_WARPS,
        )
    return status
