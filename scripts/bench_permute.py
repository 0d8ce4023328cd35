"""Benchmark recpipe.ops.permute_2D_sparse_data against fbgemm's op (and a plain copy).

    python scripts/bench_permute.py                         # CPU, small shape
    python scripts/bench_permute.py --device cuda --shapes small,large

Data as in torchrec's permute benchmark: lengths [T, B] uniform in [0, 2 * pooling], int64 ids,
float32 weights, a random permutation of the T features. Variants, run interleaved (round-robin)
so that drift hits them all alike:

- ``fbgemm``          fbgemm.permute_2D_sparse_data, no permuted_lengths_sum (it syncs)
- ``fbgemm+sum``      fbgemm with permuted_lengths_sum (what KeyedJaggedTensor.permute does)
- ``ours``            recpipe op, no sum, no buffers (syncs once)
- ``ours+sum``        recpipe op with the sum, allocating its outputs
- ``ours+prealloc``   recpipe op with the sum and preallocated outputs (zero allocations)
- ``fbgemm+prealloc`` fbgemm.permute_2D_sparse_preallocated_out (fbgemm_gpu >= 1.8) with the sum
                      and the same buffers (it checks no buffer). Where fbgemm_gpu lacks it (1.6
                      on the GPU kit) the row is skipped, with a note under the table
- ``copy``            one device copy of the bytes the permute reads and writes

Columns: host time per call (the Python + launch cost, with the device idle when the call
starts) and its ratio to fbgemm+sum's; device time P50/P90: CUDA events around the call, with a
spin kernel queued first so that the host has launched everything before the GPU reaches the
start event (the op's GPU execution alone; on CPU the wall time), and its ratio to
fbgemm+sum's; peak memory allocated by one call above what was allocated before it; effective
bandwidth (bytes read + written per call over the device time) as a fraction of ``copy``'s in
the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import fbgemm_gpu  # noqa: F401
import torch

import recpipe.ops
from recpipe.bench.gpu_timing import device_ms
from recpipe.bench.permute_inputs import SHAPES, Inputs, make_inputs


PREALLOC_OP = "permute_2D_sparse_preallocated_out"
HAS_FBGEMM_PREALLOC = hasattr(torch.ops.fbgemm, PREALLOC_OP)  # fbgemm_gpu >= 1.8


def variants(x: Inputs) -> dict[str, Callable[[], object]]:
    lo = torch.empty_like(x.lengths)
    vo = torch.empty(x.n, dtype=x.values.dtype, device=x.values.device)
    wo = None if x.weights is None else torch.empty_like(vo, dtype=x.weights.dtype)
    fb = torch.ops.fbgemm
    ours = recpipe.ops.permute_2D_sparse_data
    args = (x.permute, x.lengths, x.values, x.weights)
    src = torch.empty(x.bytes_moved // 2, dtype=torch.uint8, device=x.values.device)
    dst = torch.empty_like(src)
    out = {
        "fbgemm": lambda: fb.permute_2D_sparse_data(*args, None),
        "fbgemm+sum": lambda: fb.permute_2D_sparse_data(*args, x.n),
        "ours": lambda: ours(*args),
        "ours+sum": lambda: ours(*args, x.n),
        "ours+prealloc": lambda: ours(*args, x.n, lo, vo, wo),
    }
    if HAS_FBGEMM_PREALLOC:
        out["fbgemm+prealloc"] = lambda: fb.permute_2D_sparse_preallocated_out(*args, x.n, lo, vo, wo)
    out["copy"] = lambda: dst.copy_(src)
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_once(fn: Callable[[], object], device: str) -> tuple[float, float, int]:
    """(host ms, device ms, peak bytes allocated above the start) of one call."""
    sync(device)
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        return host, host, 0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    result = fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    del result
    device = device_ms(fn)
    peak = torch.cuda.max_memory_allocated() - base
    return host, device, peak


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_shape(name: str, device: str, rounds: int, iters: int, weighted: bool) -> list[str]:
    T, B, pooling = SHAPES[name]
    x = make_inputs(T, B, pooling, device, weighted)
    fns = variants(x)
    ref = torch.ops.fbgemm.permute_2D_sparse_data(x.permute, x.lengths, x.values, x.weights, x.n)
    for k, fn in fns.items():  # warm up (Triton compiles) and check every variant's result
        for _ in range(3):
            got = fn()
        if k != "copy":
            assert all(
                (a is None and b is None) or torch.equal(a, b) for a, b in zip(got, ref)
            ), f"{k} differs from fbgemm"
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k] += [measure_once(fn, device) for _ in range(iters)]
    copy_bw = x.bytes_moved / statistics.median(s[1] for s in samples["copy"])
    fbgemm_host = statistics.median(s[0] for s in samples["fbgemm+sum"])
    fbgemm_dev = statistics.median(s[1] for s in samples["fbgemm+sum"])
    rows = [
        f"\n### {name}: T={T} features, B={B}, pooling {pooling}, n={x.n:,} values, "
        f"weights={'yes' if weighted else 'no'}, {x.bytes_moved / 2**20:.1f} MiB moved per call, "
        f"device {device}\n",
        "| variant | host ms P50 | host vs fbgemm+sum | device ms P50 | device ms P90 | "
        "device vs fbgemm+sum | peak alloc MiB | bandwidth vs copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, s in samples.items():
        host = statistics.median(v[0] for v in s)
        devs = [v[1] for v in s]
        dev50 = statistics.median(devs)
        peak = max(v[2] for v in s) / 2**20
        bw = x.bytes_moved / dev50 / copy_bw
        rows.append(
            f"| {k} | {host:.3f} | {host / fbgemm_host:.2f}x | {dev50:.3f} | {pct(devs, 0.9):.3f} | "
            f"{dev50 / fbgemm_dev:.2f}x | {peak:.1f} | {bw:.0%} |"
        )
    if not HAS_FBGEMM_PREALLOC:
        version = getattr(fbgemm_gpu, "__version__", "?")
        rows.append(
            f"\nfbgemm+prealloc: skipped, fbgemm_gpu {version} has no fbgemm.{PREALLOC_OP} "
            "(fbgemm_gpu >= 1.8)"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (the Triton kernels) or cpu (default: cuda where present)")
    p.add_argument("--shapes", default="small", help=f"comma-separated of {sorted(SHAPES)}")
    p.add_argument("--rounds", type=int, default=5, help="round-robin passes over the variants")
    p.add_argument("--iters", type=int, default=20, help="calls per variant per round")
    p.add_argument("--weighted", action="store_true", help="permute float32 weights too")
    a = p.parse_args()
    versions = f"torch {torch.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}"
    if a.device == "cuda":
        versions += f", {torch.cuda.get_device_name()}"
    print(f"bench_permute: {versions}; {a.rounds} rounds x {a.iters} calls per variant")
    for name in a.shapes.split(","):
        print("\n".join(run_shape(name, a.device, a.rounds, a.iters, a.weighted)), flush=True)


if __name__ == "__main__":
    main()
