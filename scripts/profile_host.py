"""Host cost of two pipelines in one process, one rank: Python calls per step, a cProfile diff,
and the step time (median of 5 x ``--steps``, synchronized).

    python scripts/profile_host.py --config small --pipelines torchrec,recpipe

Both pipelines train the same model on the same batches (cycled), one after the other, after
``--warmup`` steps each. The diff lists, per step, the functions whose call count or own time
differ most (second pipeline minus first): where a slower host path spends its time. Only the
ratio within one run compares; the second pipeline runs on a process that has warmed up.

``--blocks N``: instead, the interleaved host-time method (issue 41), to tell a few percent apart:

    python scripts/profile_host.py --config small --blocks 20 --block-steps 10 --json host.json
    python scripts/profile_host.py --config tiny --ranks 2 --blocks 20   # 2 gloo ranks (torchrun)

Each pipeline has its own model (same seed), built once, and cycles its own batches. After
``--warmup`` steps each, N rounds run one block of ``--block-steps`` steps of each pipeline, the
order alternating per round (AB, BA, ...) so that the machine's drift and phases hit both alike.
Per block: the host's CPU time per step (``time.thread_time()`` summed around each
``progress()`` call: the calling thread's CPU time, not wall, so waits do not count) and the
wall time per step (the block's wall time / steps, CUDA synchronized only at the block's end, so
that the host is not serialized per step; on a GPU wall ms per step is thus a block's
throughput). Reported per pipeline: the median over blocks; per metric, the ratio second/first
as the median of the per-round paired ratios with its distribution-free 95% interval
(:func:`recpipe.bench.stats.median_interval`). Python calls per step (``sys.setprofile`` events)
come from separate ``--calls-steps`` steps after the timed rounds, so that profiling does not
distort the timing. Rank 0 prints a markdown table (and ``--json``). ``--config movielens``: the
training app's MovieLens-100k model and batches (batch 256, dim 16; needs the data file).

``--first-step N``: what happens once per process. N rounds of one fresh process per pipeline
(the order alternating per round), each timed from its launch to the end of its first
``progress()`` (CUDA synchronized): imports, the model, the pipeline's first step with its
first uses (Triton compiles, allocations). Reported: the median and min-max per pipeline, and
of the first ``progress()`` alone; the difference second minus first.

    python scripts/profile_host.py --config movielens --first-step 5
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from itertools import cycle

import json
import subprocess
from collections.abc import Callable

import torch
import torch.distributed as dist

from recpipe.bench.configs import CONFIGS
from recpipe.bench.stats import median_interval, median_spread
from recpipe.bench.variants import PIPELINES, pipeline_names
from recpipe.testing.launch import rank_backend_device
from recpipe.testing.synthetic import Batch, ModelSpec, build_sharded, make_batch

MOVIELENS = "movielens"  # --config: the training app's MovieLens model and batches


def calls_per_step(step, n: int) -> float:
    """Python calls (``sys.setprofile`` "call" and "c_call" events) per ``step()``."""
    count = 0

    def tracer(frame, event, arg) -> None:  # noqa: ANN001
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(tracer)
    try:
        for _ in range(n):
            step()
    finally:
        sys.setprofile(None)
    return count / n


def spec_and_data(config: str, rank: int, world: int, n: int = 3) -> tuple[ModelSpec, list[Batch]]:
    """The model spec and ``n`` distinct batches of ``rank``: a bench config's synthetic ones,
    or (``movielens``) the training app's MovieLens source with its default data and model
    settings (configs/data/movielens.yaml: batch 256; configs/model/movielens.yaml: dim 16)."""
    if config != MOVIELENS:
        return CONFIGS[config], [make_batch(CONFIGS[config], seed=rank * 1000 + i) for i in range(n)]
    from recpipe.train.config import DataConfig, ModelConfig
    from recpipe.train.movielens import MovieLensSource

    source = MovieLensSource.from_config(DataConfig(schema=MOVIELENS, batch_size=256),
                                         ModelConfig(dim=16, over_arch=[64, 32]), seed=0)
    return source.spec, list(source.train_batches(rank, world, 0, n))


def no_sync() -> None:
    """The CPU's stand-in for ``torch.cuda.synchronize``."""


def sync_of(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA), or nothing (CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else no_sync


def warm_step(name: str, a: argparse.Namespace, device: torch.device, spec: ModelSpec,
              data: list) -> Callable[[], None]:
    """One ``progress()`` of pipeline ``name`` on its own model (seed 1) and its own cycle of
    ``data``, after ``a.warmup`` such steps."""
    model, optimizer = build_sharded(spec, a.sharding.split(","), device, dist.group.WORLD, seed=1)
    pipeline = PIPELINES[name](model, optimizer, device)
    it = cycle(data)

    def step() -> None:
        pipeline.progress(it)

    for _ in range(a.warmup):
        step()
    return step


def measure(name: str, a: argparse.Namespace, device: torch.device, data: list) -> dict:
    step = warm_step(name, a, device, CONFIGS[a.config], data)
    sync = sync_of(device)
    calls = calls_per_step(step, a.steps)
    def steps() -> None:
        for _ in range(a.steps):
            step()
        sync()

    profile = cProfile.Profile()
    sync()
    profile.runcall(steps)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / a.steps * 1e3)
    print(f"{name}: {calls:.0f} Python calls/step, {statistics.median(times):.3f} ms/step "
          f"({min(times):.3f}-{max(times):.3f}, 5 x {a.steps} steps)", flush=True)
    return dict(stats=pstats.Stats(profile).stats)


def timed_block(step: Callable[[], None], steps: int, sync: Callable[[], None]) -> tuple[float, float]:
    """``(host CPU ms, wall ms)`` per step over ``steps`` calls of ``step``: the thread's CPU
    time summed around each call, and the block's wall time (synchronized once, at its end:
    the previous block's end synchronized its start) divided by ``steps``."""
    cpu = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        c0 = time.thread_time()
        step()
        cpu += time.thread_time() - c0
    sync()
    wall = time.perf_counter() - t0
    return cpu / steps * 1e3, wall / steps * 1e3


def interleaved(steps: list[Callable[[], None]], rounds: int, block_steps: int,
                sync: Callable[[], None]) -> list[list[tuple[float, float]]]:
    """Per pipeline, its blocks' ``(host CPU ms, wall ms)`` per step: ``rounds`` rounds of one
    block each, in the given order in even rounds and reversed in odd ones."""
    blocks: list[list[tuple[float, float]]] = [[] for _ in steps]
    for r in range(rounds):
        order = range(len(steps)) if r % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            blocks[i].append(timed_block(steps[i], block_steps, sync))
    return blocks


def paired_ratio(first: list[float], second: list[float]) -> dict[str, float]:
    """Second over first, round by round: the median ratio and its 95% interval."""
    lo, mid, hi = median_interval([b / a for a, b in zip(first, second)])
    return dict(ratio=mid, lo=lo, hi=hi)


def summary(names: list[str], blocks: list[list[tuple[float, float]]], calls: list[float]) -> dict:
    """Per pipeline the median host CPU and wall ms per step over its blocks and its calls per
    step; per metric the paired ratio second/first (:func:`paired_ratio`)."""
    columns = [dict(cpu_ms=[c for c, _ in bs], wall_ms=[w for _, w in bs]) for bs in blocks]
    return dict(
        pipelines=[dict(name=n, cpu_ms=statistics.median(c["cpu_ms"]),
                        wall_ms=statistics.median(c["wall_ms"]), calls=k, blocks=c)
                   for n, c, k in zip(names, columns, calls)],
        ratio={m: paired_ratio(columns[0][m], columns[1][m]) for m in ("cpu_ms", "wall_ms")}
        | dict(calls=calls[1] / calls[0]),
    )


def markdown(res: dict) -> str:
    """The summary as a markdown table: one row per pipeline, then the ratio row."""
    first, second = (p["name"] for p in res["pipelines"])
    r = res["ratio"]
    rows = [f"### host time, {res['config']}, {res['world']} rank(s), {res['device']}: "
            f"{res['rounds']} rounds x {res['block_steps']} steps, alternating",
            "| pipeline | host CPU ms/step | wall ms/step | Python calls/step |",
            "|---|---:|---:|---:|"]
    rows += [f"| {p['name']} | {p['cpu_ms']:.3f} | {p['wall_ms']:.3f} | {p['calls']:.0f} |"
             for p in res["pipelines"]]
    cell = "{ratio:.3f}x [{lo:.3f}, {hi:.3f}]".format
    rows.append(f"| {second} / {first} (95% interval) | {cell(**r['cpu_ms'])} | "
                f"{cell(**r['wall_ms'])} | {r['calls']:.3f}x |")
    return "\n".join(rows)


def host_time(a: argparse.Namespace, device: torch.device, rank: int) -> None:
    """The interleaved method (module docstring); rank 0 prints the table and writes ``--json``."""
    spec, data = spec_and_data(a.config, rank, dist.get_world_size())
    if device.type == "cuda":
        data = [b.pin_memory() for b in data]
    sync = sync_of(device)
    steps = [warm_step(n, a, device, spec, data) for n in a.pipelines]
    sync()
    blocks = interleaved(steps, a.blocks, a.block_steps, sync)
    calls = [calls_per_step(s, a.calls_steps) for s in steps]
    res = summary(a.pipelines, blocks, calls)
    res.update(config=a.config, world=dist.get_world_size(), rounds=a.blocks,
               block_steps=a.block_steps, device=torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu")
    if rank == 0:
        print(markdown(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)


def first_step_child(a: argparse.Namespace, device: torch.device) -> None:
    """A fresh process's first step of pipeline ``a.first_step_of``: prints its wall clock at
    the end and the first ``progress()``'s own seconds, as JSON."""
    spec, data = spec_and_data(a.config, 0, 1)
    model, optimizer = build_sharded(spec, a.sharding.split(","), device, dist.group.WORLD, seed=1)
    pipeline = PIPELINES[a.first_step_of](model, optimizer, device)
    t0 = time.perf_counter()
    pipeline.progress(cycle(data))
    sync_of(device)()
    print(json.dumps(dict(end=time.time(), progress_s=time.perf_counter() - t0)), flush=True)


def first_steps(a: argparse.Namespace) -> None:
    """``--first-step``: fresh processes, alternating, timed from launch (module docstring)."""
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in a.pipelines}
    args = ["--config", a.config, "--sharding", a.sharding]
    for r in range(a.first_step):
        for name in a.pipelines if r % 2 == 0 else reversed(a.pipelines):
            start = time.time()
            out = subprocess.run([sys.executable, __file__, *args, "--first-step-of", name],
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"error: {name}'s process failed:\n{out.stderr[-2000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append((got["end"] - start, got["progress_s"]))
            print(f"round {r + 1}/{a.first_step}: {name} {runs[name][-1][0]:.2f} s "
                  f"(first progress() {runs[name][-1][1]:.2f} s)", flush=True)  # (a cut run keeps these)
    print(f"### first step, {a.config}, fresh processes, {a.first_step} alternating rounds")
    print("| pipeline | launch to first step s, median (min-max) | first progress() s |\n|---|---|---|")
    for name, rs in runs.items():
        print(f"| {name} | {median_spread([t for t, _ in rs], '.2f')} | "
              f"{median_spread([p for _, p in rs], '.2f')} |")
    first, second = (statistics.median(t for t, _ in runs[n]) for n in a.pipelines)
    print(f"{a.pipelines[1]} - {a.pipelines[0]}: {second - first:+.2f} s (medians)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=a.config, rounds=a.first_step, runs=runs), f, indent=1)


def diff(first: dict, second: dict, steps: int, rows: int) -> None:
    """Per step: calls, own time and cumulative time, second minus first, by own time."""
    def key(k: tuple) -> str:
        return f"{os.path.basename(k[0])}:{k[1]}:{k[2]}"

    lines = []
    for k in set(first) | set(second):
        a, b = first.get(k, (0, 0, 0, 0)), second.get(k, (0, 0, 0, 0))
        lines.append(((b[1] - a[1]) / steps, (b[2] - a[2]) / steps * 1e3,
                      (b[3] - a[3]) / steps * 1e3, key(k)))
    print(f"{'calls':>8} {'own ms':>8} {'cum ms':>8}  function (per step, second - first)")
    for calls, own, cum, name in sorted(lines, key=lambda r: -abs(r[1]))[:rows]:
        print(f"{calls:8.1f} {own:8.3f} {cum:8.3f}  {name[-100:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", choices=[*sorted(CONFIGS), MOVIELENS],
                   help="the model and batch (recpipe.bench.configs, or movielens; default: small)")
    p.add_argument("--pipelines", default="torchrec,recpipe", type=pipeline_names,
                   help="two, comma-separated: the second is compared with the first")
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="comma-separated sharding types (default: table_wise,column_wise)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: 20)")
    p.add_argument("--steps", type=int, default=50,
                   help="steps per measurement: calls, cProfile, each of 5 timings (default: 50)")
    p.add_argument("--rows", type=int, default=30, help="lines of the diff (default: 30)")
    p.add_argument("--blocks", type=int, default=0,
                   help="the interleaved host-time method: this many rounds (default: 0, off)")
    p.add_argument("--block-steps", type=int, default=10, help="steps per block (default: 10)")
    p.add_argument("--calls-steps", type=int, default=10,
                   help="--blocks: steps counted for Python calls per step, after the timing")
    p.add_argument("--ranks", type=int, default=1,
                   help="--blocks: ranks, started by torchrun (gloo on the CPU; default: 1)")
    p.add_argument("--json", help="--blocks, --first-step: write the summary and every run here")
    p.add_argument("--first-step", type=int, default=0,
                   help="rounds of fresh processes timed to their first step (default: 0, off)")
    p.add_argument("--first-step-of", default=None, help=argparse.SUPPRESS)  # (the child)
    a = p.parse_args()
    if len(a.pipelines) != 2:
        p.error("--pipelines takes two names")
    if a.first_step < 0 or a.blocks < 0:
        p.error("--first-step and --blocks take a count >= 0 (0: off)")
    if a.first_step and (a.blocks or a.ranks > 1):
        p.error("--first-step runs alone: drop --blocks and --ranks")
    if a.first_step:
        return first_steps(a)
    if a.config == MOVIELENS and not (a.blocks or a.first_step_of):
        p.error("--config movielens needs --blocks or --first-step")
    if a.ranks > 1 and "RANK" not in os.environ:
        if not a.blocks:
            p.error("--ranks needs --blocks")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={a.ranks}", *sys.argv]
        raise SystemExit(subprocess.run(cmd).returncode)
    if "RANK" in os.environ and not a.blocks:
        p.error("under torchrun: --blocks only")
    if "RANK" in os.environ:  # a torchrun rank: the launch helpers' backend and device
        backend, device = rank_backend_device(int(os.environ["LOCAL_RANK"]),
                                              int(os.environ["LOCAL_WORLD_SIZE"]))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        host_time(a, device, dist.get_rank())
        return dist.destroy_process_group()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if a.first_step_of:
        first_step_child(a, device)
        return dist.destroy_process_group()
    if a.blocks:
        host_time(a, device, 0)
        return dist.destroy_process_group()
    _, data = spec_and_data(a.config, 0, 1)
    if cuda:
        data = [b.pin_memory() for b in data]
    first, second = (measure(n, a, device, data) for n in a.pipelines)
    diff(first["stats"], second["stats"], a.steps, a.rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
