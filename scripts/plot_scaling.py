"""Scaling with GPU count, from the JSON files of scripts/bench_pipeline.py (``--json``) and
scripts/bench_allreduce.py (``--json``), one file per GPU count (issue 7).

    python scripts/plot_scaling.py --pipeline large-2.json large-4.json large-8.json \\
        --allreduce ar-2.json ar-4.json ar-8.json --plot scaling.png

Prints a markdown table (ms/iter P50 and peak reserved per pipeline; all-reduce P50 per variant
at ``--bucket``) by GPU count, and writes a PNG with both against the GPU count (needs
matplotlib: run it here, not on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import statistics


def pipeline_rows(paths: list[str]) -> dict[int, dict[str, tuple[float, float]]]:
    """world -> pipeline -> (median ms/iter P50, median peak reserved MiB) over the runs."""
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for path in paths:
        with open(path) as f:
            runs = json.load(f)["runs"]
        world = next(iter(runs.values()))[0]["world"]
        out[world] = {
            name: (statistics.median(statistics.median(r["ms"]) for r in rs),
                   statistics.median(r["reserved"] for r in rs))
            for name, rs in runs.items()
        }
    return dict(sorted(out.items()))


def allreduce_rows(paths: list[str], bucket: int, dtype: str) -> dict[int, dict[str, float]]:
    """world -> variant -> P50 us at ``bucket`` bytes and ``dtype``."""
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        out[saved["world"]] = {r["variant"]: r["p50_us"] for r in saved["rows"]
                               if r["bytes"] == bucket and r["dtype"] == dtype}
    return dict(sorted(out.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pipeline", nargs="*", default=[],
                   help="bench_pipeline.py --json files, one per GPU count")
    p.add_argument("--allreduce", nargs="*", default=[],
                   help="bench_allreduce.py --json files, one per GPU count")
    p.add_argument("--bucket", type=int, default=16 << 20, help="all-reduce size shown (bytes)")
    p.add_argument("--dtype", default="float32", help="the all-reduce dtype shown")
    p.add_argument("--plot", default=None, help="write a PNG here")
    a = p.parse_args()
    pipes = pipeline_rows(a.pipeline)
    ars = allreduce_rows(a.allreduce, a.bucket, a.dtype)
    names = sorted({n for row in pipes.values() for n in row})
    variants = sorted({v for row in ars.values() for v in row})
    print("| GPUs | " + " | ".join(f"{n} ms/iter | {n} reserved MiB" for n in names)
          + "".join(f" | all-reduce {v} us" for v in variants) + " |")
    print("|---" * (1 + 2 * len(names) + len(variants)) + "|")
    for world in sorted(set(pipes) | set(ars)):
        cells = [f"{pipes[world][n][0]:.1f} | {pipes[world][n][1]:.0f}" if n in pipes.get(world, {})
                 else " | " for n in names]
        cells += [f"{ars[world][v]:.1f}" if v in ars.get(world, {}) else "" for v in variants]
        print(f"| {world} | " + " | ".join(cells) + " |")
    if not a.plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        worlds = [w for w in pipes if n in pipes[w]]
        left.plot(worlds, [pipes[w][n][0] for w in worlds], marker="o", label=n)
    left.set_xlabel("GPUs")
    left.set_ylabel("ms/iter (P50, median of runs)")
    left.legend()
    for v in variants:
        worlds = [w for w in ars if v in ars[w]]
        right.plot(worlds, [ars[w][v] for w in worlds], marker="o", label=v)
    right.set_xlabel("GPUs")
    right.set_ylabel(f"all-reduce P50 us ({a.bucket >> 10} KiB {a.dtype})")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(sorted(set(pipes) | set(ars)))
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
