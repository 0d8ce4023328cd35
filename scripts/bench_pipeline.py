"""torchrec's TrainPipelineSparseDist vs recpipe's, same model and data, in one run.

    python scripts/bench_pipeline.py --config small                    # 1 GPU (or CPU)
    torchrun --nproc-per-node=2 scripts/bench_pipeline.py --config large

Each pipeline runs ``--repeats`` times, alternating (identical runs differ by several ms and a
few hundred MiB on 2 H200), each run on a freshly built model: ``--warmup`` steps, then
``--steps`` timed steps. Per step: CUDA events on the main stream around ``progress()``. Per
run: peak allocated/reserved (``torch.cuda.max_memory_*``), allocator retries. The table (rank
0's numbers) shows medians over the runs with min-max; losses of every run are checked equal
across pipelines. ``KJT MiB``: bytes of one batch's permuted KJTs on this rank (the input KJTs,
all features kept).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import replace
from itertools import cycle, islice

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline

from recpipe.pipeline import TrainPipelineSparseDist as RecpipePipeline
from recpipe.pipeline.synthetic import ModelSpec, make_batch, build_sharded

CONFIGS = {
    # 16 tables x 200k rows x dim 128, batch 4096 per rank, 40 ids per feature
    "small": ModelSpec(num_tables=16, rows=200_000, dim=128, batch_size=4096, pooling=40,
                       weighted=False, sequence=False),
    # one batch's permuted KJTs: 32 x 16384 x 256 ids x 8 B = 1.0 GiB (+ lengths)
    "large": ModelSpec(num_tables=32, rows=200_000, dim=128, batch_size=16384, pooling=256,
                       weighted=False, sequence=False),
    "tiny": ModelSpec(num_tables=4, rows=1000, dim=16, batch_size=64, pooling=4),
}
PIPELINES = {"torchrec": TorchrecPipeline, "recpipe": RecpipePipeline}


def kjt_bytes(batch) -> int:
    total = 0
    for kjt in batch.sparse.values():
        for t in (kjt.values(), kjt.lengths(), kjt.weights_or_none()):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def run_once(name, spec, sharding, device, data, warmup, steps) -> dict:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    model, optimizer = build_sharded(spec, sharding, device, dist.group.WORLD, seed=1)
    pipeline = PIPELINES[name](model, optimizer, device)
    it = iter(islice(cycle(data), warmup + steps))
    losses, times, allocated = [], [], []
    for step in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss, _, _ = pipeline.progress(it)
        if cuda:
            end.record()
        losses.append(loss)
        if cuda:
            allocated.append(torch.cuda.memory_allocated())
        if step >= warmup:
            times.append((start, end) if cuda else time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in times]
        stats = torch.cuda.memory_stats()
        mem = dict(
            alloc=torch.cuda.max_memory_allocated() / 2**20,
            reserved=torch.cuda.max_memory_reserved() / 2**20,
            retries=stats.get("num_alloc_retries", 0) - retries0,
            growth=(allocated[-1] - allocated[warmup]) / 2**20,  # after warm-up to the end
        )
    else:
        ms = [t * 1e3 for t in times]
        mem = dict(alloc=0.0, reserved=0.0, retries=0, growth=0.0)
    out = dict(ms=ms, losses=[x.item() for x in losses], **mem)
    del pipeline, model, optimizer, it
    return out


def fmt(xs: list[float], spec: str = ".0f") -> str:
    return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--pipelines", default="torchrec,recpipe")
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="sharding types, cycled over tables (mixing makes the input dist permute)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=None, help="override the config's")
    p.add_argument("--distinct-batches", type=int, default=3, help="batches generated, cycled")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    a = p.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # a plain single-process run
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    spec = CONFIGS[a.config]
    if a.batch_size:
        spec = replace(spec, batch_size=a.batch_size)
    sharding = a.sharding.split(",")
    names = a.pipelines.split(",")
    t0 = time.perf_counter()
    data = [make_batch(spec, seed=rank * 1000 + i) for i in range(a.distinct_batches)]
    if cuda:
        data = [b.pin_memory() for b in data]
    kjt_mib = kjt_bytes(data[0]) / 2**20
    if rank == 0:
        print(f"bench_pipeline: {a.config} {spec}, sharding {sharding}, world {world}, "
              f"{kjt_mib:.0f} MiB of KJTs per batch per rank (data made in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.repeats):
        for name in names:
            res = run_once(name, spec, sharding, device, data, a.warmup, a.steps)
            runs[name].append(res)
            if rank == 0:
                print(f"  run {r + 1}/{a.repeats} {name:9s}: {statistics.median(res['ms']):7.2f} ms/iter"
                      f"  peak alloc {res['alloc']:8.0f} MiB  reserved {res['reserved']:8.0f} MiB"
                      f"  retries {res['retries']}  allocated growth {res['growth']:+.1f} MiB", flush=True)
    ref = runs[names[0]][0]["losses"]
    same = all(run["losses"] == ref for n in names for run in runs[n])
    rows = [
        f"| pipeline | ms/iter P50 | ms/iter P90 | peak alloc MiB | peak reserved MiB | alloc retries | KJT MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rs = runs[name]
        p50 = [statistics.median(x["ms"]) for x in rs]
        p90 = [sorted(x["ms"])[int(0.9 * (len(x["ms"]) - 1))] for x in rs]
        rows.append(
            f"| {name} | {fmt(p50, '.1f')} | {fmt(p90, '.1f')} | {fmt([x['alloc'] for x in rs])} | "
            f"{fmt([x['reserved'] for x in rs])} | {max(x['retries'] for x in rs)} | {kjt_mib:.0f} |"
        )
    if len(names) == 2:
        base, ours = ([statistics.median([statistics.median(x["ms"]) for x in runs[n]]) for n in names])
        res_b, res_o = ([statistics.median([x["reserved"] for x in runs[n]]) for n in names])
        rows.append(f"\n{names[1]} vs {names[0]}: ms/iter P50 {ours / base:.3f}x, peak reserved "
                    f"{res_o - res_b:+.0f} MiB ({(res_b - res_o) / kjt_mib:.2f}x one batch's KJTs saved); "
                    f"losses identical across all runs: {same}")
    if rank == 0:
        dev = torch.cuda.get_device_name() if cuda else "cpu"
        head = (f"\n### {a.config}, {world} x {dev}, sharding {'+'.join(sharding)}, "
                f"{a.repeats} alternating runs x {a.steps} steps (after {a.warmup} warm-up)\n")
        table = head + "\n".join(rows)
        print(table, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(table + "\n")
    dist.destroy_process_group()
    if not same:
        raise SystemExit("losses differ between pipelines")


if __name__ == "__main__":
    main()
