"""Sweep the copy kernel's launch parameters on the GPU (large shape; ours with preallocated
outputs), printing device ms P50 per configuration next to fbgemm and a plain copy.

    python scripts/tune_permute.py [--shape large] [--weighted]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

import recpipe.ops
from recpipe.bench import gpu_timing
from recpipe.bench.permute_inputs import SHAPES, make_inputs
from recpipe.ops import permute_triton


def device_ms(fn, iters: int = 30) -> float:
    """Median of ``iters`` timings (``gpu_timing.device_ms``) after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(gpu_timing.device_ms(fn) for _ in range(iters))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="large", choices=sorted(SHAPES), help="the inputs' shape")
    p.add_argument("--weighted", action="store_true", help="permute float32 weights too")
    a = p.parse_args()
    x = make_inputs(*SHAPES[a.shape], "cuda", a.weighted)
    lo, vo = torch.empty_like(x.lengths), torch.empty(x.n, dtype=x.values.dtype, device="cuda")
    wo = None if x.weights is None else torch.empty(x.n, dtype=x.weights.dtype, device="cuda")
    args = (x.permute, x.lengths, x.values, x.weights)
    src = torch.empty(x.bytes_moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fb = device_ms(lambda: torch.ops.fbgemm.permute_2D_sparse_data(*args, x.n))
    cp = device_ms(lambda: dst.copy_(src))
    print(f"{a.shape}: fbgemm+sum {fb:.3f} ms, copy {cp:.3f} ms")
    rows = []
    for block, warps, target in itertools.product([512, 1024, 2048, 4096], [4, 8, 16], [1024, 2048, 4096]):
        permute_triton.COPY_LONG_ROWS = permute_triton.COPY_SHORT_ROWS = (block, warps)
        permute_triton.TARGET_PROGRAMS = target
        ms = device_ms(lambda: recpipe.ops.permute_2D_sparse_data(*args, x.n, lo, vo, wo))
        rows.append((ms, block, warps, target))
    for ms, block, warps, target in sorted(rows)[:12]:
        print(f"BLOCK={block:5d} warps={warps:2d} programs={target:5d}: {ms:.3f} ms "
              f"({ms / fb:.2f}x fbgemm, {x.bytes_moved / ms / (x.bytes_moved / cp):.0%} of copy)")


if __name__ == "__main__":
    main()
