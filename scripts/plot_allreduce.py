"""All-reduce latency against bucket size, from a latency table (``recpipe.ops.all_reduce_table``),
with what ``dense_allreduce=auto`` picks at each measured size.

    python scripts/plot_allreduce.py                                     # the shipped 2 x H200 table
    python scripts/plot_allreduce.py --table ~/.cache/recpipe/all_reduce/KEY.json --plot ar.png
    python scripts/plot_allreduce.py --dtype bfloat16,float32 --plot ar.png  # a column per dtype

Prints a markdown table (P50 microseconds per algorithm, auto's pick, its P50 ratio to NCCL and,
where the table has them, the 95% interval of the per-call ratio of each symmetric algorithm)
per dtype of ``--dtype``, and writes a PNG (needs matplotlib), a column per dtype: the P50s
(log-log, the sizes where auto leaves NCCL shaded) and, where the table has intervals, below
them each symmetric algorithm's ratio interval against 1 and auto's bar (``1 - MARGIN``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from recpipe.ops.all_reduce_table import (
    ALGORITHMS,
    MARGIN,
    LatencyTable,
    Machine,
    dtype_name,
    read_table,
    shipped_path,
)

H200 = Machine("NVIDIA H200", 2, "", "")


def rows(table: LatencyTable, dtype: torch.dtype) -> list[dict]:
    """Per measured size: bytes, each algorithm's P50, auto's pick and its P50, and each
    symmetric algorithm's ratio interval (``ci``: none in a schema 1 table)."""
    lat = table.dtypes[dtype_name(dtype)]
    out = []
    for i, size in enumerate(lat.sizes):
        us = {a: lat.us[a][i] for a in ALGORITHMS if a in lat.us}
        pick = table.choose(size, dtype)
        ci = {a: lat.ci[a][i] for a in lat.ci}
        out.append({"bytes": size, **us, "auto": pick, "auto_us": us[pick], "ci": ci})
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def markdown(table: LatencyTable, data: list[dict]) -> str:
    algos = [a for a in ALGORITHMS if a in data[0]]
    m = table.machine
    cis = list(data[0]["ci"])
    lines = [f"{m.device}, {m.world} ranks (torch {m.torch}, NCCL {m.nccl}). {table.note}", "",
             "| bucket | " + " | ".join(algos) + " | auto picks | auto / NCCL |"
             + "".join(f" {a} / NCCL, 95% |" for a in cis),
             "|---" * (len(algos) + 3 + len(cis)) + "|"]
    for r in data:
        lines.append(f"| {_size(r['bytes'])} | " + " | ".join(f"{r[a]:.1f}" for a in algos)
                     + f" | {r['auto']} | {r['auto_us'] / r['nccl']:.2f}x |"
                     + "".join(f" {r['ci'][a][0]:.2f}-{r['ci'][a][1]:.2f} |" for a in cis))
    return "\n".join(lines)


def symmetric_spans(data: list[dict]) -> list[tuple[int, int]]:
    """The byte ranges where auto leaves NCCL: runs of consecutive measured sizes where it does
    (between two measured sizes it needs a win at both)."""
    spans: list[tuple[int, int]] = []
    for prev, r in zip([None, *data], data):
        if r["auto"] == "nccl":
            continue
        if prev is not None and prev["auto"] != "nccl":
            spans[-1] = (spans[-1][0], r["bytes"])
        else:
            spans.append((r["bytes"], r["bytes"]))
    return spans


def plot(panels: list[tuple[str, list[dict], list[tuple[int, int]]]], path: str, title: str) -> None:
    """A column per ``(dtype, rows, spans)`` of ``panels``: P50s, and the ratio intervals below
    where the rows have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ci = any(r["ci"] for _, data, _ in panels for r in data)
    nrows = 2 if with_ci else 1
    fig, axes = plt.subplots(nrows, len(panels), figsize=(7 * len(panels), 4.2 * nrows),
                             squeeze=False, sharex="col")
    for col, (dtype, data, spans) in enumerate(panels):
        sizes = [r["bytes"] for r in data]
        ax = axes[0][col]
        for lo, hi in spans:
            for a in axes[:, col]:
                a.axvspan(lo, hi, color="tab:green", alpha=0.12, lw=0)
        for a in (a for a in ALGORITHMS if a in data[0]):
            ax.plot(sizes, [r[a] for r in data], marker="o", label=a.replace("_", "-"))
        ax.plot(sizes, [r["auto_us"] for r in data], "k--", lw=2, label="auto (its pick)")
        ax.set(xscale="log", yscale="log", ylabel="P50 latency (us)", title=f"{title}, {dtype}")
        ax.legend(title="shaded: auto leaves NCCL")
        if with_ci:
            ax = axes[1][col]
            for k, a in enumerate(data[0]["ci"]):
                shift = 1.08 ** (k - 0.5)  # side by side on the log axis
                lo = [r["ci"][a][0] for r in data]
                hi = [r["ci"][a][1] for r in data]
                mid = [(x + y) / 2 for x, y in zip(lo, hi)]
                ax.errorbar([s * shift for s in sizes], mid, yerr=[[m - x for m, x in zip(mid, lo)],
                            [y - m for m, y in zip(mid, hi)]], fmt="none", capsize=3, lw=2,
                            color=f"C{1 + k}", label=f"{a.replace('_', '-')} / NCCL, 95%")
            ax.axhline(1, color="k", lw=1)
            ax.axhline(1 - MARGIN, color="k", ls=":", lw=1, label=f"auto's bar ({1 - MARGIN:.2f})")
            ax.set(xscale="log", ylabel="latency / NCCL's (per call)")
            ax.legend(fontsize=8)
        axes[-1][col].set_xlabel("bucket bytes")
        axes[-1][col].set_xticks(sizes, [_size(s) for s in sizes], rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="a table file (default: the shipped 2 x H200 one)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the table's dtypes shown, comma-separated (default: bfloat16)")
    parser.add_argument("--plot", help="write a PNG here")
    args = parser.parse_args()
    table = read_table(args.table or shipped_path(H200))
    panels = []
    for dtype in args.dtype.split(","):
        data = rows(table, getattr(torch, dtype))
        print(("\n" if panels else "") + f"### {dtype}\n\n" * (len(args.dtype.split(",")) > 1)
              + markdown(table, data))
        panels.append((dtype, data, symmetric_spans(data)))
    if args.plot:
        m = table.machine
        plot(panels, args.plot, f"all-reduce, {m.world} x {m.device}")


if __name__ == "__main__":
    main()
