"""Statistics the benchmarks share: the median's interval (``scripts/bench_allreduce.py``'s
per-call ratios, ``scripts/profile_host.py --blocks``'s per-round ratios of two pipelines) and
the median with the range of runs (``bench_pipeline.py``'s and ``profile_host.py``'s tables)."""

from __future__ import annotations

import math
import statistics


def median_spread(xs: list[float], spec: str = ".0f") -> str:
    """``median (min-max)`` of ``xs``, each formatted by ``spec``: a table cell for runs."""
    return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"


def median_interval(xs: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """The median of ``xs`` and its distribution-free 95% interval (``z`` = 1.96): the order
    statistics of ranks ``(n - z sqrt(n)) / 2`` and ``1 + (n + z sqrt(n)) / 2`` (1-based,
    outward), between which the true median lies with about 95% probability for independent
    samples (the count of samples below it is binomial; normal approximation). Few samples: the
    whole range."""
    xs = sorted(xs)
    n = len(xs)
    half = z * math.sqrt(n)
    lo, hi = max(math.floor((n - half) / 2), 1), min(math.ceil(1 + (n + half) / 2), n)
    return xs[lo - 1], statistics.median(xs), xs[hi - 1]
