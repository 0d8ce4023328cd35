"""How much of each collective's GPU time no compute kernel hides, from torch.profiler traces.

    python scripts/exposed_comm.py TRACE.json [TRACE.json ...]

Each trace is a chrome trace of ``bench_pipeline.py --profile DIR`` (``DIR/<pipeline>-rank0.json``:
torch.profiler with CUDA activity, 3 profiled steps). Its GPU kernels fall in three groups by
name: all-reduce (NCCL's ``AllReduce``, symmetric memory's kernels: its barriers too),
all-to-all (NCCL's ``SendRecv``/``AllToAll``) and compute (every other kernel). Per profiled step
the table gives each collective group's busy time (the union of its kernels' intervals) and its
exposed time: the part of the busy time during which no compute kernel runs on any stream, i.e.
what the step would lose if that collective were slower, and what it could gain at most if it
were free. Reads JSON only (no torch): runs on any machine.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence

GROUPS = {
    "all-reduce": re.compile(r"AllReduce|all_reduce|symmetric_memory", re.IGNORECASE),
    "all-to-all": re.compile(r"SendRecv|AllToAll|all_to_all", re.IGNORECASE),
}

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Sequence[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def minus(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of ``a`` (disjoint, sorted) outside ``b`` (disjoint, sorted)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def analyse(trace: object) -> dict[str, float]:
    """Per-step µs: each collective group's busy and exposed time, compute's busy time, and the
    GPU span (first kernel start to last kernel end); ``steps``, the profiled steps counted.
    A ``ValueError`` saying what is missing where ``trace`` is no profiler trace of a GPU run."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ValueError("not a chrome trace (no list of traceEvents)")
    events = [e for e in events if isinstance(e, dict)]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e and "ts" in e]
    steps = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                and e.get("ph") == "X")
    if not kernels or not steps:
        raise ValueError("no GPU kernels or no ProfilerStep# events: profile with CUDA activity "
                         "(bench_pipeline.py --profile on a GPU)")
    grouped: dict[str, list[Interval]] = {g: [] for g in (*GROUPS, "compute")}
    for e in kernels:
        group = next((g for g, pattern in GROUPS.items() if pattern.search(e["name"])), "compute")
        grouped[group].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    compute = union(grouped["compute"])
    out = {"steps": float(steps), "compute busy": length(compute) / steps}
    for group in GROUPS:
        busy = union(grouped[group])
        out[f"{group} busy"] = length(busy) / steps
        out[f"{group} exposed"] = length(minus(busy, compute)) / steps
    starts = [float(e["ts"]) for e in kernels]
    ends = [float(e["ts"]) + float(e["dur"]) for e in kernels]
    out["GPU span"] = (max(ends) - min(starts)) / steps
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    cols = ["steps", "GPU span", "compute busy", "all-reduce busy", "all-reduce exposed",
            "all-to-all busy", "all-to-all exposed"]
    lines = ["| trace | " + " | ".join(c if c == "steps" else f"{c} ms/step" for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name, r in rows.items():
        cells = [f"{r[c]:.0f}" if c == "steps" else f"{r[c] / 1e3:.3f}" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="chrome traces of bench_pipeline.py --profile")
    a = p.parse_args(argv)
    rows = {}
    for path in a.traces:
        try:
            with open(path) as f:
                rows[path] = analyse(json.load(f))
        except json.JSONDecodeError as e:
            sys.exit(f"exposed_comm.py: {path}: not JSON ({e}): pass a trace that "
                     "bench_pipeline.py --profile wrote")
        except (OSError, ValueError) as e:
            sys.exit(f"exposed_comm.py: {path}: {e}")
    print(table(rows))


if __name__ == "__main__":
    main()
