"""Every pipeline on the memory-time plane: ms/iter against peak reserved memory.

    python scripts/plot_pareto.py RUNS.json [RUNS.json ...] --plot plane.png [--table plane.md]

Each ``RUNS.json`` is a ``scripts/bench_pipeline.py --json`` file (one config, several
pipelines, alternating runs) and becomes one panel: per pipeline, the median point with min-max
whiskers on both axes (each run's own median ms/iter; each run's peak reserved MiB of rank 0).
Runs of ranks that share one GPU over gloo (``RECPIPE_SHARED_GPU=1``) have meaningless
timings: their panel shows memory only. The markdown table gives the same numbers, each
pipeline's ratio to torchrec's ``TrainPipelineSparseDist`` (``torchrec``) and the share of the
pipelining tax (``torchrec`` minus ``torchrec_base``) it removes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    """One pipeline of one panel: medians and min-max over its runs."""

    name: str
    ms: tuple[float, float, float]  # median, min, max of the runs' median ms/iter
    mib: tuple[float, float, float]  # median, min, max of the runs' peak reserved MiB
    runs: int


def _spread(xs: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def points(saved: dict) -> list[Point]:
    """The pipelines of one ``bench_pipeline.py --json`` file, in its order."""
    return [
        Point(name, _spread([statistics.median(r["ms"]) for r in rs]),
              _spread([r["reserved"] for r in rs]), len(rs))
        for name, rs in saved["runs"].items()
    ]


def timings_meaningful(saved: dict) -> bool:
    """False for ranks sharing one GPU over gloo (the bench marks their device so), and for a
    file marked ``"timed": false`` (runs merged from several machines: only memory compares)."""
    runs = next(iter(saved["runs"].values()))
    return saved.get("timed", True) and "share" not in runs[0].get("device", "")


def markdown(title: str, pts: list[Point], timed: bool) -> str:
    by = {p.name: p for p in pts}
    ref, base = by.get("torchrec"), by.get("torchrec_base")
    tax = ref.mib[0] - base.mib[0] if ref and base else 0.0
    head = "| pipeline | runs | peak reserved MiB | tax removed |"
    head += " ms/iter | vs torchrec |" if timed else ""
    lines = [f"**{title}**", "", head, "|" + "---|" * (head.count("|") - 1)]
    for p in pts:
        removed = f"{100 * (ref.mib[0] - p.mib[0]) / tax:.0f}%" if tax > 0 else "-"
        row = (f"| {p.name} | {p.runs} | {p.mib[0]:.0f} ({p.mib[1]:.0f}-{p.mib[2]:.0f}) | "
               f"{removed} |")
        if timed:
            ratio = f"{p.ms[0] / ref.ms[0]:.3f}x" if ref else "-"
            row += f" {p.ms[0]:.2f} ({p.ms[1]:.2f}-{p.ms[2]:.2f}) | {ratio} |"
        lines.append(row)
    if tax > 0:
        lines.append(f"\nThe tax (torchrec - torchrec_base): {tax:.0f} MiB.")
    return "\n".join(lines)


def plot(panels: list[tuple[str, list[Point], bool]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (title, pts, timed) in zip(axes[0], panels):
        for i, p in enumerate(pts):
            c = colors[i % len(colors)]
            y = p.ms[0] if timed else i
            yerr = [[p.ms[0] - p.ms[1]], [p.ms[2] - p.ms[0]]] if timed else None
            ax.errorbar(p.mib[0], y, xerr=[[p.mib[0] - p.mib[1]], [p.mib[2] - p.mib[0]]],
                        yerr=yerr, fmt="o", color=c, capsize=3, label=p.name)
            ax.annotate(p.name, (p.mib[0], y), textcoords="offset points", xytext=(5, 4),
                        fontsize=7, color=c)
        ax.set_xlabel("peak reserved MiB (rank 0)")
        if timed:
            ax.set_ylabel("ms/iter (median of runs)")
        else:
            ax.set_yticks([])
            ax.set_ylabel("memory only (timings not comparable)")
        ax.set_title(textwrap.fill(title, 70), fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("runs", nargs="+", help="bench_pipeline.py --json files, one panel each")
    p.add_argument("--plot", default=None, help="write the PNG here (needs matplotlib)")
    p.add_argument("--table", default=None, help="also write the markdown tables here")
    a = p.parse_args(argv)
    panels, text = [], []
    for f in a.runs:
        try:
            saved = json.loads(Path(f).read_text())
            pts, title = points(saved), saved["title"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {f} is not a bench_pipeline.py --json file ({e})") from None
        timed = timings_meaningful(saved)
        panels.append((title, pts, timed))
        text.append(markdown(title, pts, timed))
    print("\n\n".join(text))
    if a.table:
        Path(a.table).write_text("\n\n".join(text) + "\n")
    if a.plot:
        plot(panels, a.plot)


if __name__ == "__main__":
    main()
