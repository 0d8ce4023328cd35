"""Host cost of two pipelines in one process, one rank: Python calls per step, a cProfile diff,
and the step time (median of 5 x ``--steps``, synchronized).

    python scripts/profile_host.py --config small --pipelines torchrec,recpipe

Both pipelines train the same model on the same batches (cycled), one after the other, after
``--warmup`` steps each. The diff lists, per step, the functions whose call count or own time
differ most (second pipeline minus first): where a slower host path spends its time. Only the
ratio within one run compares; the second pipeline runs on a process that has warmed up.
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

import torch
import torch.distributed as dist

from recpipe.bench.configs import CONFIGS
from recpipe.bench.variants import PIPELINES, pipeline_names
from recpipe.testing.synthetic import build_sharded, make_batch


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


def measure(name: str, a: argparse.Namespace, device: torch.device, data: list) -> dict:
    model, optimizer = build_sharded(CONFIGS[a.config], a.sharding.split(","), device,
                                     dist.group.WORLD, seed=1)
    pipeline = PIPELINES[name](model, optimizer, device)
    it = cycle(data)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        pipeline.progress(it)

    for _ in range(a.warmup):
        step()
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
    p.add_argument("--config", default="small", choices=sorted(CONFIGS),
                   help="the model and batch (recpipe.bench.configs; default: small)")
    p.add_argument("--pipelines", default="torchrec,recpipe", type=pipeline_names,
                   help="two, comma-separated: the second is compared with the first")
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="comma-separated sharding types (default: table_wise,column_wise)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: 20)")
    p.add_argument("--steps", type=int, default=50,
                   help="steps per measurement: calls, cProfile, each of 5 timings (default: 50)")
    p.add_argument("--rows", type=int, default=30, help="lines of the diff (default: 30)")
    a = p.parse_args()
    if len(a.pipelines) != 2:
        p.error("--pipelines takes two names")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    data = [make_batch(CONFIGS[a.config], seed=i) for i in range(3)]
    if cuda:
        data = [b.pin_memory() for b in data]
    first, second = (measure(n, a, device, data) for n in a.pipelines)
    diff(first["stats"], second["stats"], a.steps, a.rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
