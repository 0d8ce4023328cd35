"""All-reduce latency against bucket size, from a latency table (``recpipe.ops.all_reduce_table``),
with what ``dense_allreduce=auto`` picks at each measured size.

    python scripts/plot_allreduce.py                                     # the shipped 2 x H200 table
    python scripts/plot_allreduce.py --table ~/.cache/recpipe/all_reduce/KEY.json --plot ar.png

Prints a markdown table (P50 microseconds per algorithm, auto's pick, its P50 ratio to NCCL and,
where the table has them, the 95% interval of the per-call ratio of each symmetric algorithm)
for ``--dtype``, and writes a PNG (log-log, the sizes where auto leaves NCCL shaded; needs
matplotlib).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from recpipe.ops.all_reduce_table import (
    ALGORITHMS,
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


def plot(data: list[dict], spans: list[tuple[int, int]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["bytes"] for r in data]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lo, hi in spans:
        ax.axvspan(lo, hi, color="tab:green", alpha=0.12, lw=0)
    for a in (a for a in ALGORITHMS if a in data[0]):
        ax.plot(sizes, [r[a] for r in data], marker="o", label=a.replace("_", "-"))
    ax.plot(sizes, [r["auto_us"] for r in data], "k--", lw=2, label="auto (its pick)")
    ax.set(xscale="log", yscale="log", xlabel="bucket bytes", ylabel="P50 latency (us)", title=title)
    ax.set_xticks(sizes, [_size(s) for s in sizes], rotation=45)
    ax.legend(title="shaded: auto leaves NCCL")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="a table file (default: the shipped 2 x H200 one)")
    parser.add_argument("--dtype", default="bfloat16", help="the table's dtype shown (default: bfloat16)")
    parser.add_argument("--plot", help="write a PNG here")
    args = parser.parse_args()
    table = read_table(args.table or shipped_path(H200))
    data = rows(table, getattr(torch, args.dtype))
    print(markdown(table, data))
    if args.plot:
        m = table.machine
        plot(data, symmetric_spans(data), args.plot, f"all-reduce, {args.dtype}, {m.world} x {m.device}")


if __name__ == "__main__":
    main()
