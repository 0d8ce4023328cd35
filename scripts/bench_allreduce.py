"""Dense all-reduce latency: NCCL (c10d) vs symmetric memory one-shot and two-shot (eager and
compiled) vs ``BucketedAllReduce(algorithm="auto")``'s choice; ``--write-table`` keeps the
measurements as this machine's all-reduce table (``recpipe.ops.all_reduce_table``), which
``"auto"`` reads.

    torchrun --nproc-per-node=2 scripts/bench_allreduce.py                 # 2 GPUs
    torchrun --nproc-per-node=2 scripts/bench_allreduce.py --write-table   # ... and keep the table
    torchrun --nproc-per-node=2 scripts/bench_allreduce.py --sizes 4K,1M   # CPU/gloo: nccl and auto (gloo)

Every variant reduces what a gradient bucket is: 4 chunks, concatenated and summed over ranks
(the concatenation is counted everywhere, as bucketing needs it):

- ``nccl``: ``torch.cat`` + ``dist.all_reduce`` (gloo on CPU);
- ``symm_one_shot`` / ``symm_two_shot`` (CUDA): ``all_reduce_flat(chunks, algorithm=...)``,
  eager: ``torch.cat(out=)`` into the persistent symmetric buffer + ``one_shot_all_reduce`` /
  ``two_shot_all_reduce_out`` (compiled two-shot runs the same);
- ``compiled_one_shot`` (CUDA): ``compile_symmetric`` of the same: the cat writes straight into
  symmetric memory, reduced there (no copy);
- ``auto``: what ``BucketedAllReduce(algorithm="auto")``'s DDP hook runs for such a bucket once
  the ``cat`` has made it one flat tensor (as DDP's bucket): where the table picks NCCL, DDP's
  default hook (divide, c10d's ``all_reduce``; on CPU gloo), else ``symmetric_mean_`` (divided
  while copied into the persistent symmetric buffer, summed back into the bucket); its
  division is counted, as DDP divides too.

Per size and dtype: P50 (and P10-P90) microseconds over ``--iters`` calls (200: enough to tell
a few percent apart), each after a barrier and timed with CUDA events behind a spin kernel
(:func:`time_us`; wall clock on CPU), variants interleaved (call ``i`` of every variant in the
same round, in an order shuffled per round); bus bandwidth ``2 (n-1)/n * bytes / time``; the
ratio of the P50s to ``nccl``'s; and the per-call ratio (call ``i`` over ``nccl``'s call ``i``:
rounds share the machine's state) as its median with a distribution-free 95% interval
(:func:`median_interval`). Rank 0 prints a markdown table, and for ``auto`` the
sizes where the interval shows it slower than NCCL (lower end above 1) or not winning by
``--win-below`` (upper end above it) in the sizes it should win (``--win-sizes``). Multicast
stays off.

``--write-table`` (CUDA): rank 0 writes the P50s and intervals to
``all_reduce_table.cache_path(machine)`` (``<dir>/<gpu>-w<world>-torch<version>-nccl<version>.json``,
``<dir>``: ``$RECPIPE_ALL_REDUCE_CACHE``, else ``$XDG_CACHE_HOME/recpipe/all_reduce``, by default
``~/.cache/recpipe/all_reduce``): ``nccl``; ``one_shot``, the slower of ``symm_one_shot`` (a copy,
as for a one-tensor bucket) and ``compiled_one_shot`` (in place), with the interval of the one
whose upper end is higher; ``two_shot``, ``symm_two_shot``. To ship it, copy it to
``ops/all_reduce_tables/<gpu>-w<world>.json``.

``--table-from JSON`` (no run, any machine): the same table from the rows of an earlier run's
``--json`` file (which records the device, world size, versions and ``--iters``; for a file
from before it recorded the versions, pass them as ``--versions TORCH,NCCL``; ``--iters`` then
stands for its calls), written to ``--table-out`` (default: the cache path of the file's
machine)::

    python scripts/bench_allreduce.py --table-from allreduce-200-2.json \
        --table-out ops/all_reduce_tables/NVIDIA_H200-w2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from recpipe.bench.gpu_timing import device_ms
from recpipe.bench.stats import median_interval
from recpipe.ops.all_reduce import all_reduce_flat, choose_algorithm, compile_symmetric, symmetric_mean_
from recpipe.ops.all_reduce_table import (
    Latencies,
    LatencyTable,
    Machine,
    cache_path,
    dtype_name,
    local_machine,
    write_table,
)
from recpipe.testing.launch import rank_backend_device

UNITS = {"K": 2**10, "M": 2**20}


def parse_size(s: str) -> int:
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def variants(nbytes: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup):
    """name -> (chunks, fn) for a bucket of ``nbytes``."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    chunks = [torch.randn(n // 4, device=device).to(dtype) for _ in range(4)]
    out = {}

    def nccl():
        flat = torch.cat(chunks)
        dist.all_reduce(flat, group=group)
        return flat

    def compiled(algorithm: str):
        fn = compile_symmetric(lambda *cs: all_reduce_flat(cs, group, algorithm))
        return lambda: fn(*chunks)

    out["nccl"] = nccl
    if device.type == "cuda":
        out["symm_one_shot"] = lambda: all_reduce_flat(chunks, group, "one_shot")
        if dist.get_world_size(group) in (2, 4, 8):
            out["symm_two_shot"] = lambda: all_reduce_flat(chunks, group, "two_shot")
        out["compiled_one_shot"] = compiled("one_shot")
    chosen = choose_algorithm(nbytes, dtype, device, group, "auto")
    def auto():  # as BucketedAllReduce's hook reduces a DDP bucket
        flat = torch.cat(chunks)
        if chosen != "nccl":
            return symmetric_mean_(flat, group, chosen)
        dist.all_reduce(flat.div_(dist.get_world_size(group)), group=group)
        return flat

    out["auto"] = auto
    return chunks, out


#: the table's algorithms: the slowest of the variants that run each
TABLE_VARIANTS = {"nccl": ("nccl",), "one_shot": ("symm_one_shot", "compiled_one_shot"),
                  "two_shot": ("symm_two_shot",)}


def latency_table(records: list[dict], machine: Machine, calls: int) -> LatencyTable:
    """``machine``'s table from the bench's rows (``records``), of ``calls`` calls per size."""
    rec = {(r["dtype"], r["bytes"], r["variant"]): r for r in records}
    dtypes = {}
    for dtype in dict.fromkeys(d for d, _, _ in rec):
        sizes = sorted({b for d, b, _ in rec if d == dtype})
        measured = {a: vs for a, vs in TABLE_VARIANTS.items()
                    if all((dtype, sizes[0], v) in rec for v in vs)}
        us = {a: tuple(max(rec[dtype, b, v]["p50_us"] for v in vs) for b in sizes)
              for a, vs in measured.items()}
        ci = {a: tuple(max((tuple(rec[dtype, b, v]["ratio_ci95"]) for v in vs), key=lambda x: x[1])
                       for b in sizes)
              for a, vs in measured.items() if a != "nccl"}
        dtypes[dtype] = Latencies(tuple(sizes), us, ci)
    return LatencyTable(machine, dtypes, note=f"scripts/bench_allreduce.py --write-table, {calls} "
                        "interleaved calls per size")


def table_from_json(obj: dict, versions: tuple[str, str] | None = None, calls: int | None = None,
                    source: str = "") -> LatencyTable:
    """The table ``--write-table`` would have written, from the parsed ``--json`` file ``obj`` of a
    CUDA run: its machine from the file (``versions``, torch and NCCL, where the file does not
    record them), ``calls`` where it does not record its ``iters``; ``source`` named in the note.
    ``ValueError`` saying what is missing."""
    if (not isinstance(obj, dict) or obj.get("device", "cpu") == "cpu"
            or not isinstance(obj.get("rows"), list) or "world" not in obj):
        raise ValueError("not the --json file of a CUDA run (needs 'device', a GPU, 'world' and 'rows')")
    found = (obj.get("torch"), obj.get("nccl"))
    torch_version, nccl_version = found if all(found) else versions or (None, None)
    if not (torch_version and nccl_version):
        raise ValueError("the file does not record the torch and NCCL versions: pass --versions TORCH,NCCL")
    if any(not {"p50_us", "ratio_ci95"} <= set(r) for r in obj["rows"]):
        raise ValueError("its rows have no 95% intervals (a run before them): measure again with --json")
    calls = obj.get("iters", calls)
    if not calls:
        raise ValueError("the file does not record its calls per size: pass --iters")
    table = latency_table(obj["rows"], Machine(obj["device"], obj["world"], torch_version,
                                               nccl_version), calls)
    return dataclasses.replace(table, note=f"{table.note}; rebuilt by --table-from {source}"
                               if source else table.note)


def auto_verdict(records: list[dict], win_sizes: tuple[int, int], win_below: float) -> list[str]:
    """Where ``auto`` fails the issue's bar: its per-call ratio's interval lies
    above 1 (slower than NCCL), or, at sizes in ``win_sizes`` (bytes, inclusive), its upper end
    is above ``win_below``."""
    bad = []
    for r in records:
        if r["variant"] != "auto":
            continue
        lo, hi = r["ratio_ci95"]
        where = f"{r['dtype']} {r['bytes']} B: {r['ratio']:.2f}x [{lo:.2f}, {hi:.2f}]"
        if lo > 1:
            bad.append(f"slower than NCCL at {where}")
        elif win_sizes[0] <= r["bytes"] <= win_sizes[1] and hi > win_below:
            bad.append(f"not <= {win_below:.2f}x at {where}")
    return bad


_SPIN_CYCLES = 1_000_000  # ~0.5 ms: longer than the host time of any call here


def time_us(fn, device: torch.device) -> float:
    """Device time of one call (CUDA: events, with a spin kernel queued first, so that the
    host has queued the whole call before the GPU reaches it: launch and Python costs, hidden
    behind the GPU in training, are not counted); wall clock on CPU."""
    if device.type == "cuda":
        return device_ms(fn, _SPIN_CYCLES) * 1e3
    t0 = time.perf_counter()
    r = fn()
    if isinstance(r, funcol.AsyncCollectiveTensor):
        r.wait()
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,2M,4M,16M,64M",
                   help="comma-separated message sizes in bytes (K, M suffixes)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated torch dtypes")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per size, dtype and algorithm (default: 200; with --table-from: "
                        "the calls of a file that does not record them)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    p.add_argument("--json", default=None, help="also write the rows here (rank 0)")
    p.add_argument("--win-sizes", default="2M,16M",
                   help="LOW,HIGH bytes where auto should win by --win-below (verdict only)")
    p.add_argument("--win-below", type=float, default=0.85, help="(verdict only)")
    p.add_argument("--write-table", action="store_true",
                   help="write the P50s as this machine's all-reduce table (CUDA; rank 0)")
    p.add_argument("--table-from", metavar="JSON",
                   help="no run: write the table from this --json file of a CUDA run (any machine)")
    p.add_argument("--table-out", metavar="PATH",
                   help="with --table-from: where (default: the cache path of the file's machine)")
    p.add_argument("--versions", metavar="TORCH,NCCL",
                   help="with --table-from: the versions measured, for a file that lacks them")
    a = p.parse_args()
    if a.table_from:
        versions = tuple(a.versions.split(",")) if a.versions else None
        if versions is not None and len(versions) != 2:
            p.error("--versions takes TORCH,NCCL")
        try:
            with open(a.table_from) as f:
                table = table_from_json(json.load(f), versions, a.iters, os.path.basename(a.table_from))
        except (OSError, ValueError) as e:
            p.error(f"--table-from {a.table_from}: {e}")
        path = a.table_out or cache_path(table.machine)
        write_table(table, Path(path))
        print(f"wrote {path} ({table.machine}: {table.note})")
        return
    a.iters = a.iters or 200
    if a.table_out or a.versions:
        p.error("--table-out and --versions go with --table-from")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # One compiled function per (size, dtype, algorithm), all from one lambda: dynamo keeps their
    # graphs together, so allow one graph each.
    torch._dynamo.config.recompile_limit = 256
    backend, device = rank_backend_device(int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    elif a.write_table:
        p.error("--write-table needs CUDA: the table is of GPU all-reduces")
    dist.init_process_group(backend)
    group = dist.group.WORLD
    world = dist.get_world_size()
    if cuda:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
    rows, records = [], []
    for dtype in [getattr(torch, d) for d in a.dtypes.split(",")]:
        dname = dtype_name(dtype)
        for size in a.sizes.split(","):
            nbytes = parse_size(size)
            chunks, fns = variants(nbytes, dtype, device, group)
            ref = fns["nccl"]().float()
            for name, fn in fns.items():  # warm up, compile, check the sums agree
                for _ in range(a.warmup):
                    r = fn()
                r = r.wait() if isinstance(r, funcol.AsyncCollectiveTensor) else r
                mean = name == "auto"  # (the hook's mean)
                torch.testing.assert_close(r.float(), ref / dist.get_world_size(group) if mean else ref,
                                           rtol=2e-2, atol=1e-2)
            samples = {k: [] for k in fns}
            for i in range(a.iters):
                order = list(fns)
                random.Random(i).shuffle(order)  # the same order on every rank, each round another
                for k in order:
                    dist.barrier()
                    samples[k].append(time_us(fns[k], device))
            base = statistics.median(samples["nccl"])
            for k, xs in samples.items():
                lo, ratio, hi = median_interval([x / n for x, n in zip(xs, samples["nccl"])])
                xs = sorted(xs)
                med = statistics.median(xs)
                busbw = 2 * (world - 1) / world * nbytes / (med * 1e-6) / 1e9
                rows.append(f"| {dname} | {size} | {k} | {med:.1f} | {xs[len(xs) // 10]:.1f}-"
                            f"{xs[9 * len(xs) // 10]:.1f} | {busbw:.1f} | {med / base:.2f}x | "
                            f"{ratio:.3f} [{lo:.3f}, {hi:.3f}] |")
                records.append(dict(dtype=dname, bytes=nbytes, variant=k, p50_us=med,
                                    busbw=busbw, vs_nccl=med / base, ratio=ratio,
                                    ratio_ci95=[lo, hi]))
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        if a.json:
            versions = {"torch": torch.__version__, "iters": a.iters}
            if cuda:
                versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            with open(a.json, "w") as f:
                json.dump({"world": world, "device": name, **versions, "rows": records}, f)
        print(f"\n### all-reduce, {world} x {name}, torch {torch.__version__}, {a.iters} interleaved calls\n")
        print("| dtype | bucket | variant | P50 us | P10-P90 us | bus GB/s | P50 / nccl's | "
              "per-call ratio to nccl: median [95%] |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        win_sizes = tuple(parse_size(x) for x in a.win_sizes.split(","))
        bad = auto_verdict(records, win_sizes, a.win_below)
        print(f"\nauto (as BucketedAllReduce runs it) within its 95% intervals: never slower than NCCL, <= "
              f"{a.win_below:.2f}x at {a.win_sizes}: " + ("yes" if not bad else "no: " + "; ".join(bad)))
        if a.write_table:
            table = latency_table(records, local_machine(world), a.iters)
            write_table(table, cache_path(table.machine))
            print(f"\nwrote {cache_path(table.machine)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
