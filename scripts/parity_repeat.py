"""Consecutive 2-rank runs of one parity case, recpipe's losses against torchrec's, bit for bit
in every run; it stops at the first difference (exit 1) and says which run.

    python scripts/parity_repeat.py --runs 200                  # 2 GPUs: table-/row-/column-wise
    python scripts/parity_repeat.py --runs 20 --time-limit 60   # CPU (gloo): table-/column-wise

The case is ``tests/test_pipeline_parity.py``'s: every CUDA default acting from the first batch
(``ActOnSmallBatchesPipeline``: the permuted copy, high-water P1 and all-to-all outputs, and
with row-wise tables P2's outputs), on the mixed plan with row-wise tables where 2 GPUs are
visible; on CPU (torchrec's CPU planner has no row-wise) table-/column-wise, with the CPU's
defaults. The two rank processes are started once and train a fresh model and pipeline per
run. ``--time-limit``: no run starts after this many seconds; the last line says how many ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from dist_utils import run_ranks  # noqa: E402
from test_pipeline_parity import SHARDINGS, STEPS, ActOnSmallBatchesPipeline, _train  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="consecutive runs (default: 200)")
    p.add_argument("--time-limit", type=float, default=None, help="start no run after this many seconds")
    a = p.parse_args()
    if a.runs < 1:
        p.error("--runs takes a count >= 1")
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    plan = "mixed_tw_rw_cw" if gpus else "mixed_tw_cw"
    start, done = time.monotonic(), 0
    for run in tqdm(range(1, a.runs + 1), desc=f"parity {plan}", unit="run"):
        if a.time_limit is not None and time.monotonic() - start > a.time_limit:
            break
        for rank, r in enumerate(run_ranks(2, _train, SHARDINGS[plan], STEPS, ActOnSmallBatchesPipeline)):
            if r["recpipe"] != r["torchrec"] or len(r["torchrec"]) != STEPS:
                print(f"parity_repeat: run {run}, rank {rank}: recpipe's losses differ from torchrec's "
                      f"({plan}, {STEPS} steps)", file=sys.stderr)
                return 1
        done = run
    print(f"parity_repeat: {done} of {a.runs} consecutive runs bit-identical ({plan}, {STEPS} steps, "
          f"2 ranks on {'2 GPUs' if gpus else 'CPU'}, {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
