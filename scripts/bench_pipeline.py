"""torchrec's TrainPipelineSparseDist vs recpipe's, same model and data, in one run.

    python scripts/bench_pipeline.py --config small                    # 1 GPU (or CPU)
    torchrun --nproc-per-node=2 scripts/bench_pipeline.py --config large

Each pipeline runs ``--repeats`` times, alternating (identical runs can differ by several ms and
a few hundred MiB), each run in fresh processes (``torchrun``, so that no allocator
state or model leaks from one run into the next): ``--warmup`` steps, then ``--steps`` timed
steps. The data is made once per rank and cached under ``--data-dir``. Per step: CUDA events on
the main stream around ``progress()``, and the host's time in it and in its input-dist wait
(where torchrec reads the splits). Per run: peak allocated/reserved
(``torch.cuda.max_memory_*``), allocator retries, and in the ``--json`` file the dense part's
DDP buckets (bytes and all-reduce: :func:`dense_buckets`). The table (rank
0's numbers) shows medians over the runs with min-max; losses of every run are checked equal
across pipelines. The title gives the bytes of one batch's permuted KJTs on this rank (the input
KJTs, all features kept). With ``--time-limit``, no run starts that would end after the limit
(judged by the longest run so far); the table and ``--json`` cover the runs done, and the title
gives each pipeline's count where they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from itertools import cycle, islice

import torch
import torch.distributed as dist

from recpipe.bench.configs import CONFIGS
from recpipe.bench.stats import median_spread as fmt
from recpipe.bench.variants import DENSE_ALLREDUCE, PIPELINES, pipeline_names
from recpipe.kjt import kjt_nbytes
from recpipe.testing.launch import rank_backend_device
from recpipe.testing.synthetic import ModelSpec, build_sharded, deterministic_kernels, make_batch


def sanitizer_on() -> bool:
    """Whether torch's CUDA sanitizer runs (``TORCH_CUDA_SANITIZER=1`` imports and enables it).
    Never imports ``torch.cuda._sanitizer``: the import alone turns on torch's GPU trace, a Python
    callback on every CUDA allocation, event and stream sync (torch 2.11-2.14), which slows
    host-bound runs severalfold."""
    module = sys.modules.get("torch.cuda._sanitizer")
    return module is not None and bool(module.cuda_sanitizer.enabled)


def kjt_bytes(batch) -> int:
    return sum(kjt_nbytes(kjt) for kjt in batch.sparse.values())


def timed_calls(obj: object, name: str) -> list[float] | None:
    """Seconds of host time of each call of ``obj.name`` (an instance attribute that shadows
    the method, so that the object's own calls are timed too), in the returned list; None
    where ``obj`` has no such method."""
    method, seconds = getattr(obj, name, None), []
    if method is None:
        return None

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return seconds


def run_once(name, spec, sharding, device, data, warmup, steps, prof=None) -> dict:
    """One pipeline on a fresh model for ``warmup + steps`` steps: per-step ms, losses, memory,
    and the host's ms per step: in ``progress()`` (not synced: the host may run ahead of the
    device) and in the input dist's wait (``wait_sparse_data_dist``, where torchrec's host
    reads the splits, so waits for data_dist's work queued before them).
    ``prof``: a torch.profiler.profile with a schedule, stepped once per step."""
    cuda = device.type == "cuda"
    wrapper = DENSE_ALLREDUCE[name]() if name in DENSE_ALLREDUCE else None
    model, optimizer = build_sharded(spec, sharding, device, dist.group.WORLD, seed=1,
                                     data_parallel=wrapper)
    pipeline = PIPELINES[name](model, optimizer, device)
    it = iter(islice(cycle(data), warmup + steps))
    losses, times, allocated, reserved, host_ms, wait_ms = [], [], [], [], [], []
    waits = timed_calls(pipeline, "wait_sparse_data_dist")
    if prof is not None:
        prof.start()
    for step in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0, waited = time.perf_counter(), len(waits or ())
        loss, _, _ = pipeline.progress(it)
        host = time.perf_counter() - t0
        if cuda:
            end.record()
            allocated.append(torch.cuda.memory_allocated())
            reserved.append(torch.cuda.memory_reserved() / 2**20)
        losses.append(loss)
        if step >= warmup:
            times.append((start, end) if cuda else host)
            host_ms.append(host * 1e3)
            if waits is not None:
                wait_ms.append(sum(waits[waited:]) * 1e3)
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    # torch calls that took a Python round trip through recpipe's interception, per step
    stats = getattr(pipeline, "stats", None)
    seen = (stats.seen if stats is not None else 0) / (warmup + steps)
    if not cuda:
        return dict(ms=[t * 1e3 for t in times], losses=[x.item() for x in losses], alloc=0,
                    reserved=0, retries=0, growth=0, reserved_per_step=[], ring=0, seen=seen,
                    host_ms=host_ms, wait_ms=wait_ms, dense_buckets=dense_buckets(model, wrapper))
    torch.cuda.synchronize()
    mid = warmup + steps // 2
    return dict(
        ring=getattr(pipeline, "ring_nbytes", 0) / 2**20,  # recpipe's ring buffers (P1, P2)
        seen=seen,
        ring_replaced=getattr(pipeline, "ring_replaced", 0),
        ms=[s.elapsed_time(e) for s, e in times],
        host_ms=host_ms,
        wait_ms=wait_ms,
        losses=[x.item() for x in losses],
        alloc=torch.cuda.max_memory_allocated() / 2**20,
        reserved=torch.cuda.max_memory_reserved() / 2**20,
        retries=torch.cuda.memory_stats().get("num_alloc_retries", 0),
        # allocated memory from mid-run to the last step before the pipeline drains
        growth=(allocated[-3] - allocated[mid]) / 2**20,
        reserved_per_step=reserved,
        sanitizer=sanitizer_on(),
        dense_buckets=dense_buckets(model, wrapper),
    )


def dense_buckets(model: torch.nn.Module, wrapper: object) -> list[list]:
    """The dense part's DDP buckets at the end of a run, ``[bytes, all-reduce]`` each: the
    hook's plan where ``BucketedAllReduce`` registered one, else DDP's rebuilt buckets (its own
    NCCL all-reduce); none without DDP."""
    if getattr(wrapper, "hook", None) is not None:
        return [list(bucket) for bucket in wrapper.plan()]
    ddp = getattr(model, "_dmp_wrapped_module", None)
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return []
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    return [[int(b), "nccl"] for b in sizes.split(", ") if b]


def child(a: argparse.Namespace) -> None:
    """One measurement (``--run-one NAME``), on every rank of a torchrun group."""
    rank = int(os.environ.get("RANK", 0))
    backend, device = rank_backend_device(int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        if a.memory_cap_mib:  # the caching allocator refuses to reserve more (OOM past it)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(a.memory_cap_mib * 2**20 / total, device)
    dist.init_process_group(backend)
    spec = config(a)
    path = os.path.join(a.data_dir, f"{a.config}-b{spec.batch_size}-rank{rank}.pt")
    if os.path.exists(path):
        data = torch.load(path, weights_only=False)
    else:
        data = [make_batch(spec, seed=rank * 1000 + i) for i in range(a.distinct_batches)]
        torch.save(data, path)
    if cuda:
        data = [b.pin_memory() for b in data]
    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                       schedule=schedule(wait=a.warmup, warmup=1, active=3, repeat=1))
    if a.snapshot and cuda:
        from recpipe.bench.snapshot_recording import SnapshotProfiler

        os.makedirs(a.snapshot, exist_ok=True)
        prof = SnapshotProfiler(os.path.join(a.snapshot, f"{a.run_one}-rank{rank}.pickle"))
    with deterministic_kernels(a.deterministic):
        res = run_once(a.run_one, spec, a.sharding.split(","), device, data, a.warmup, a.steps, prof)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        prof.export_chrome_trace(os.path.join(a.profile, f"{a.run_one}-rank{rank}.json"))
        with open(os.path.join(a.profile, f"{a.run_one}-rank{rank}.txt"), "w") as f:
            f.write(prof.key_averages(group_by_stack_n=6).table(
                sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
    res.update(kjt_mib=kjt_bytes(data[0]) / 2**20, world=dist.get_world_size(),
               device=(torch.cuda.get_device_name() + (" (ranks share it, gloo)" if backend == "gloo" else ""))
               if cuda else "cpu")
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def config(a: argparse.Namespace) -> ModelSpec:
    spec = CONFIGS[a.config]
    return replace(spec, batch_size=a.batch_size) if a.batch_size else spec


def tax_removed(runs: dict[str, list[dict]]) -> dict[str, str]:
    """Share of the pipelining tax (median peak reserved of torchrec's SparseDist pipeline minus
    that of its unpipelined ``TrainPipelineBase``) that each pipeline removes; {} unless both
    ran."""
    if "torchrec" not in runs or "torchrec_base" not in runs:
        return {}
    res = {n: statistics.median(x["reserved"] for x in rs) for n, rs in runs.items()}
    tax = res["torchrec"] - res["torchrec_base"]
    if tax <= 0:
        return {}
    return {n: f"{100 * (res['torchrec'] - r) / tax:.0f}% of {tax:.0f} MiB" for n, r in res.items()}


def _host(rs: list[dict]) -> str:
    """The runs' median host ms per step, then in the input dist's wait ("-": not measured,
    or the pipeline has no such wait)."""
    if not all(x.get("host_ms") for x in rs):
        return "-"
    host = fmt([statistics.median(x["host_ms"]) for x in rs], ".1f")
    if not all(x.get("wait_ms") for x in rs):
        return f"{host} (-)"
    return f"{host} ({statistics.median(statistics.median(x['wait_ms']) for x in rs):.1f})"


def allocator_conf() -> str:
    """The title's note of ``PYTORCH_CUDA_ALLOC_CONF`` where it is set (it changes what peak
    reserved means), else ""."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return f", PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else ""


def _runs_title(names: list[str], runs: dict[str, list[dict]]) -> str:
    """"5 alternating runs", or each pipeline's count where a time limit cut them short."""
    counts = [len(runs[n]) for n in names]
    if len(set(counts)) == 1:
        return f"{counts[0]} alternating runs"
    return "alternating runs (" + ", ".join(f"{n} {c}" for n, c in zip(names, counts)) + ")"


def table(
    a: argparse.Namespace, names: list[str], runs: dict[str, list[dict]]
) -> tuple[str, bool]:
    """The markdown table and comparison lines, and whether the losses agree: False only where
    they differ between pipelines and can tell (``tells`` below; else run-to-run noise hides it)."""
    first = runs[names[0]][0]
    kjt_mib = first["kjt_mib"]
    rows = [
        f"\n### {a.config}: {first['world']} x {first['device']}, sharding "
        f"{a.sharding.replace(',', '+')}, {_runs_title(names, runs)} x {a.steps} steps "
        f"(after {a.warmup} warm-up){', deterministic algorithms' if a.deterministic else ''}"
        f"{allocator_conf()}; one batch's KJTs: {kjt_mib:.0f} MiB per rank\n",
        "| pipeline | ms/iter P50 | ms/iter P90 | samples/s | peak alloc MiB | peak reserved MiB | "
        "pipelining tax removed | alloc retries | alloc growth MiB | host ms/step P50 "
        "(in the input dist's wait) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    removed = tax_removed(runs)
    samples = config(a).batch_size * first["world"]  # per step, all ranks
    for name in names:
        rs = runs[name]
        p50 = [statistics.median(x["ms"]) for x in rs]
        p90 = [sorted(x["ms"])[int(0.9 * (len(x["ms"]) - 1))] for x in rs]
        rows.append(
            f"| {name} | {fmt(p50, '.1f')} | {fmt(p90, '.1f')} | {fmt([samples * 1e3 / x for x in p50])} | "
            f"{fmt([x['alloc'] for x in rs])} | "
            f"{fmt([x['reserved'] for x in rs])} | {removed.get(name, '-')} | "
            f"{max(x['retries'] for x in rs)} | "
            f"{fmt([x['growth'] for x in rs], '+.1f')} | {_host(rs)} |"
        )
    ref = runs[names[0]][0]["losses"]
    same = all(run["losses"] == ref for n in names for run in runs[n])
    own = {n: all(r["losses"] == runs[n][0]["losses"] for r in runs[n]) for n in names}
    for n in names:  # run-to-run determinism of each pipeline on its own
        rows.append(f"\n{n}: losses identical across its own runs: {own[n]}")
    # where the losses can tell the pipelines apart: deterministic kernels (or the CPU), or each
    # pipeline repeating its own losses over 2 runs or more
    tells = (a.deterministic or first["device"] == "cpu"
             or all(own[n] and len(runs[n]) > 1 for n in names))
    base = statistics.median(statistics.median(x["ms"]) for x in runs[names[0]])
    res_b = statistics.median(x["reserved"] for x in runs[names[0]])
    for n in names[1:]:  # every pipeline against the first
        ours = statistics.median(statistics.median(x["ms"]) for x in runs[n])
        res_o = statistics.median(x["reserved"] for x in runs[n])
        rows.append(
            f"\n{n} vs {names[0]}: ms/iter P50 {ours / base:.3f}x; peak reserved "
            f"{res_o - res_b:+.0f} MiB ({(res_b - res_o) / kjt_mib:.2f}x one batch's KJTs saved)"
        )
    rows.append(f"losses bit-identical across all {sum(len(r) for r in runs.values())} runs: {same}")
    if not tells:
        rows.append("(without --deterministic, GPU losses vary run to run: one run per pipeline, "
                    "or runs of one pipeline that differ, cannot tell the pipelines apart)")
    if any(x.get("sanitizer") for n in names for x in runs[n]):
        rows.append("(run under TORCH_CUDA_SANITIZER=1: timings are not representative)")
    return "\n".join(rows), same or not tells


def plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
    """PNG of reserved memory per step, every run of every pipeline (needs matplotlib: on a
    machine without it, re-plot later from the ``--json`` file with ``--replot``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for color, (name, rs) in zip(cycle(plt.get_cmap("tab10").colors), runs.items()):
        for i, r in enumerate(rs):
            ax.plot(r["reserved_per_step"], color=color, alpha=0.7, label=name if i == 0 else None)
    ax.set_xlabel("step (warm-up included)")
    ax.set_ylabel("torch.cuda.memory_reserved (MiB)")
    ax.set_title(textwrap.fill(title, 110), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS),
                   help="the model and batch (recpipe.bench.configs; default: small)")
    p.add_argument("--pipelines", default="torchrec,recpipe", type=pipeline_names,
                   help="comma-separated, alternating in this order; one of: " + ", ".join(PIPELINES))
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="sharding types, cycled over tables (mixing makes the input dist permute)")
    p.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()),
                   help="ranks, one process each (default: the GPU count, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs per pipeline, each in a fresh process, alternating (default: 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per run (default: 5)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default: 30)")
    p.add_argument("--batch-size", type=int, default=None, help="override the config's")
    p.add_argument("--distinct-batches", type=int, default=3, help="batches generated, cycled")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "recpipe-bench"),
                   help="where the generated batches are cached (default: %(default)s)")
    p.add_argument("--out", default=None, help="also append the table (markdown) here")
    p.add_argument("--profile", default=None,
                   help="write a torch.profiler chrome trace of 3 timed steps per run here")
    p.add_argument("--snapshot", default=None,
                   help="write a CUDA memory snapshot of each run here (scripts/memory_snapshot.py "
                        "prints what is live at the peak)")
    p.add_argument("--json", default=None, help="write all runs' numbers here")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms (warn only): for comparing losses "
                        "on GPU configs where the default kernels sum in varying order; slower")
    p.add_argument("--plot", default=None, help="write a PNG of reserved memory per step here")
    p.add_argument("--replot", default=None, help="only re-plot a --json file into --plot")
    p.add_argument("--memory-cap-mib", type=float, default=None,
                   help="cap each process's GPU memory (set_per_process_memory_fraction)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no run that, as long as the longest so far, would end "
                        "after this (the first always starts); the table and --json then cover "
                        "the runs done, e.g. within a device call's time limit")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.time_limit is not None and a.time_limit <= 0:
        p.error(f"--time-limit must be > 0 seconds, got {a.time_limit:g}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if a.run_one:
        return child(a)
    if a.replot:
        with open(a.replot) as f:
            saved = json.load(f)
        return plot(saved["runs"], a.plot, saved["title"])
    os.makedirs(a.data_dir, exist_ok=True)
    names = a.pipelines
    print(f"bench_pipeline: {a.config} {config(a)}, {a.nproc} process(es)", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                 if k in ("config", "sharding", "warmup", "steps", "distinct_batches", "data_dir")
                 or (k in ("batch_size", "profile", "snapshot", "memory_cap_mib") and v)]
    forwarded += ["--deterministic"] if a.deterministic else []
    started, longest = time.monotonic(), 0.0
    for r, name in ((r, n) for r in range(a.repeats) for n in names):
        if longest and time.monotonic() - started + longest > (a.time_limit or float("inf")):
            print(f"--time-limit {a.time_limit:g} s: no run {r + 1} of {name} or later", flush=True)
            break
        run_started = time.monotonic()
        result = os.path.join(a.data_dir, f"result-{name}-{r}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={a.nproc}", __file__, f"--run-one={name}", f"--result={result}",
               *forwarded]
        subprocess.run(cmd, check=True)
        with open(result) as f:
            res = json.load(f)
        runs[name].append(res)
        print(f"  run {r + 1}/{a.repeats} {name:9s}: {statistics.median(res['ms']):7.2f} ms/iter"
              f"  peak alloc {res['alloc']:7.0f} MiB  reserved {res['reserved']:7.0f} MiB"
              f"  retries {res['retries']}  alloc growth {res['growth']:+.1f} MiB"
              f"  ring {res['ring']:.0f} MiB  intercepted calls/step {res.get('seen', 0):.0f}",
              flush=True)
        longest = max(longest, time.monotonic() - run_started)
    names = [n for n in names if runs[n]]  # (the first run always starts)
    runs = {n: runs[n] for n in names}
    text, agree = table(a, names, runs)
    print(text, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")
    title = text.strip().splitlines()[0].lstrip("# ")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "runs": runs}, f)
    if a.plot:
        try:
            plot(runs, a.plot, title)
        except ImportError:
            print(f"no matplotlib here: re-plot with --replot {a.json or '<--json file>'} --plot {a.plot}")
    if not agree:
        raise SystemExit("losses differ between pipelines")


if __name__ == "__main__":
    main()
