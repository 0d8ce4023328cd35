"""Compare two training runs' ``metrics.jsonl`` (written by scripts/train.py) step by step.

    python scripts/compare_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl [--rtol 1e-5]

Prints the steps compared, the largest relative loss difference, and each run's median
samples/s over its second half (the first half holds compilation and warm-up). Exits 1 if a
loss differs by more than ``--rtol`` (default 0: bit-identical) or the steps differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "loss" in r]  # training rows (eval rows carry eval_* only)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("a", help="a run's metrics.jsonl")
    p.add_argument("b", help="the other run's metrics.jsonl")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="largest relative loss difference allowed (default 0: bit-identical)")
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    if [r["step"] for r in a] != [r["step"] for r in b] or not a:
        sys.exit(f"different or no steps: {len(a)} vs {len(b)} rows")
    diffs = [
        abs(x[k] - y[k]) / max(abs(x[k]), 1e-30) for x, y in zip(a, b) for k in ("loss", "last_loss")
    ]
    worst = max(diffs, key=lambda d: float("inf") if d != d else d)  # NaN is the worst
    for name, rows in ((args.a, a), (args.b, b)):
        rate = statistics.median(r["samples_per_s"] for r in rows[len(rows) // 2 :])
        print(f"{name}: {len(rows)} rows to step {rows[-1]['step']}, samples/s (2nd half, median) {rate:.0f}")
    same = all(x["loss"] == y["loss"] and x["last_loss"] == y["last_loss"] for x, y in zip(a, b))
    print(f"losses bit-identical: {same}; max relative difference {worst:.3g} (allowed {args.rtol:g})")
    if not all(d <= args.rtol for d in diffs) or (args.rtol == 0 and not same):  # NaN fails
        sys.exit(1)


if __name__ == "__main__":
    main()
