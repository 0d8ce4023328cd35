#!/usr/bin/env python3
"""The largest batch that trains in a fixed amount of GPU memory, per pipeline.

    python scripts/bench_max_batch.py --config large --cap-mib 21834 \\
        --pipelines torchrec,torchrec_free_clear,recpipe [--lo 16384 --hi 32768 --trials 4]

Each trial is one ``bench_pipeline.py`` run in fresh processes with the GPU memory capped
(``--memory-cap-mib``: ``torch.cuda.set_per_process_memory_fraction``) at ``--batch-size B``;
it passes when all steps run with no OOM and no allocator retry. Per pipeline, the batch size
is bisected between ``--lo`` (expected to pass) and ``--hi`` (expected to fail) in multiples of
``--step``. Prints one table: largest passing batch, its ratio to the first pipeline's, and its
samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from recpipe.bench.configs import CONFIGS
from recpipe.bench.variants import PIPELINES, pipeline_names

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_pipeline.py")


def trial(a: argparse.Namespace, name: str, batch: int) -> dict | None:
    """One capped run; its result, or None on OOM / retries."""
    out = os.path.join(a.data_dir, f"maxbatch-{name}-{batch}.json")
    cmd = [sys.executable, BENCH, f"--config={a.config}", f"--pipelines={name}", "--repeats=1",
           f"--warmup={a.warmup}", f"--steps={a.steps}", f"--batch-size={batch}",
           "--distinct-batches=1", f"--memory-cap-mib={a.cap_mib}", f"--json={out}",
           f"--data-dir={a.data_dir}", f"--sharding={a.sharding}", f"--nproc={a.nproc}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    with open(out) as f:
        res = json.load(f)["runs"][name][0]
    return None if res["retries"] else res


def largest(a: argparse.Namespace, name: str) -> tuple[int, dict | None]:
    lo, hi, best = a.lo, a.hi, None
    for _ in range(a.trials):
        if hi - lo <= a.step:
            break
        mid = (lo + hi) // 2 // a.step * a.step
        res = trial(a, name, mid)
        print(f"  {name:24s} batch {mid:6d}: {'ok' if res else 'OOM or retries'}", flush=True)
        if res:
            lo, best = mid, res
        else:
            hi = mid
    if best is None:  # confirm the lower bound itself
        best = trial(a, name, lo)
        print(f"  {name:24s} batch {lo:6d}: {'ok' if best else 'OOM or retries'}", flush=True)
    return lo if best else 0, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="large", choices=sorted(CONFIGS),
                   help="the model and batch (recpipe.bench.configs; default: large)")
    p.add_argument("--pipelines", default="torchrec,torchrec_free_clear,recpipe", type=pipeline_names,
                   help="comma-separated; ratios are to the first; one of: " + ", ".join(PIPELINES))
    p.add_argument("--cap-mib", type=float, required=True, help="GPU memory per process")
    p.add_argument("--lo", type=int, required=True, help="a batch size expected to fit")
    p.add_argument("--hi", type=int, required=True, help="a batch size expected not to fit")
    p.add_argument("--step", type=int, default=256, help="batch sizes tried are multiples of this")
    p.add_argument("--trials", type=int, default=4, help="bisection steps per pipeline")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial")
    p.add_argument("--steps", type=int, default=17, help="timed steps (20 in all by default)")
    p.add_argument("--sharding", default="table_wise,column_wise",
                   help="sharding types, cycled over tables (as bench_pipeline.py's)")
    p.add_argument("--nproc", type=int, default=1, help="ranks, one process each")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "recpipe-bench"),
                   help="where the generated batches and each trial's JSON go")
    p.add_argument("--out", default=None, help="also append the table (markdown) here")
    a = p.parse_args()
    os.makedirs(a.data_dir, exist_ok=True)
    names = a.pipelines
    found = {n: largest(a, n) for n in names}
    ref = found[names[0]][0] or 1
    rows = [f"\n### largest batch in {a.cap_mib:.0f} MiB per GPU ({a.config}, {a.nproc} GPU(s), "
            f"{a.warmup + a.steps} steps, no OOM and no allocator retry; bisected in steps of "
            f"{a.step}, {a.trials} trials)\n",
            "| pipeline | largest batch | vs first | ms/iter P50 | samples/s |", "|---|---|---|---|---|"]
    for n in names:
        batch, res = found[n]
        ms = statistics.median(res["ms"]) if res else float("nan")
        rows.append(f"| {n} | {batch} | {batch / ref:.2f}x | {ms:.1f} | "
                    f"{batch * a.nproc * 1e3 / ms:.0f} |")
    text = "\n".join(rows)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
