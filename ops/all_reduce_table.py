"""Measured all-reduce latencies, and the algorithm they choose per bucket (``algorithm="auto"``
of :func:`recpipe.ops.all_reduce.all_reduce_sum`).

A :class:`LatencyTable` holds, for one :class:`Machine` (GPU name, world size, torch and NCCL
versions) and per dtype, the measured all-reduce sizes, each algorithm's P50 latency there and,
per symmetric algorithm and size, the 95% interval of its latency's ratio to NCCL's (the
median of the per-call ratios of interleaved calls: see ``scripts/bench_allreduce.py``):
``nccl``; ``one_shot`` (in symmetric memory, in place or after a copy: the slower of the two);
``two_shot`` (copy into the persistent symmetric buffer, then two-shot). Its file (schema 2)::

    {"schema": 2, "device": "NVIDIA H200", "world": 2, "torch": "2.13.0", "nccl": "2.27.5",
     "note": "(optional) where the numbers come from",
     "dtypes": {"bfloat16": {"bytes": [4096, ...], "nccl": [11.0, ...],
                             "one_shot": [12.7, ...], "two_shot": [15.4, ...],
                             "ratio_ci95": {"one_shot": [[1.08, 1.17], ...],
                                            "two_shot": [[1.31, 1.45], ...]}}}}

``ratio_ci95`` is optional: a schema 1 file (the same without it) is still read, its P50 ratios
standing for the intervals' upper ends. The shipped 2 x H200 table (``NVIDIA_H200-w2.json``) is schema 2: 200
calls per size, bf16 and fp32 each measured (``scripts/bench_allreduce.py --table-from`` of the
run's JSON, ``docs/results/allreduce-200_2xH200_2026-11-28.json``).

:meth:`LatencyTable.choose` is never slower than NCCL on the measurements: it picks a
symmetric algorithm for ``n`` bytes only if the upper end of that algorithm's ratio interval
(the P50 ratio where the table has no interval) is at most ``1 - MARGIN`` at both measured sizes
around ``n`` (at ``n`` itself where measured): where the interval does not show a win, NCCL;
outside the measured sizes, and for a dtype the table lacks, NCCL.

:func:`load_table` reads ``cache_dir() / (machine.key + ".json")`` (what
``scripts/bench_allreduce.py --write-table`` writes), else the table shipped in
``recpipe/ops/all_reduce_tables/`` for the GPU name and world size (measured with other
versions, perhaps), else none. A file that is not a valid table is an error naming it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

SCHEMA = 2  # written; read: SCHEMAS
SCHEMAS = (1, 2)  # 1: no ratio_ci95
ALGORITHMS = ("nccl", "one_shot", "two_shot")
SYMMETRIC = ALGORITHMS[1:]
MARGIN = 0.03  # a symmetric algorithm must beat NCCL by this fraction (of NCCL's latency)
CI_KEY = "ratio_ci95"
CACHE_ENV = "RECPIPE_ALL_REDUCE_CACHE"  # overrides cache_dir()
SHIPPED = "all_reduce_tables"  # the package folder of shipped tables


class Machine(NamedTuple):
    """What a table's measurements hold for."""

    device: str  # torch.cuda.get_device_name()
    world: int
    torch: str
    nccl: str

    @property
    def key(self) -> str:
        """The cache file's name, without ``.json``: ``NVIDIA_H200-w2-torch2.13.0-nccl2.27.5``."""
        return _slug(f"{self.device}-w{self.world}-torch{self.torch}-nccl{self.nccl}")

    @property
    def shipped_name(self) -> str:
        """The shipped table's file name (any versions): ``NVIDIA_H200-w2.json``."""
        return _slug(f"{self.device}-w{self.world}") + ".json"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", s)


def local_machine(world: int) -> Machine:
    """This process's current CUDA device and versions, in a group of ``world`` ranks."""
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return Machine(torch.cuda.get_device_name(), world, torch.__version__, nccl)


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of ``dtype``: ``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Latencies:
    """One dtype's measurements: ``us[algorithm][i]`` is the P50 at ``sizes[i]`` bytes;
    ``ci[algorithm][i]``, for a symmetric algorithm, the 95% interval of its latency's ratio to
    NCCL's there (none in a schema 1 table)."""

    sizes: tuple[int, ...]  # increasing
    us: Mapping[str, tuple[float, ...]]  # "nccl" and any of SYMMETRIC
    ci: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def bracket(self, nbytes: int) -> tuple[int, ...]:
        """Indices of the measured sizes around ``nbytes`` (one on an exact match); none
        outside the measured range."""
        i = bisect_left(self.sizes, nbytes)
        if i == len(self.sizes) or (i == 0 and self.sizes[0] != nbytes):
            return ()
        return (i,) if self.sizes[i] == nbytes else (i - 1, i)

    def ratio_bound(self, algorithm: str, i: int) -> float:
        """What the measurements allow ``algorithm``'s latency to be, relative to NCCL's, at
        ``sizes[i]``: the upper end of its ratio's 95% interval, else its P50 ratio."""
        if algorithm in self.ci:
            return self.ci[algorithm][i][1]
        return self.us[algorithm][i] / self.us["nccl"][i]

    def choose(self, nbytes: int) -> str:
        """The symmetric algorithm with the best worst :meth:`ratio_bound` over the bracket of
        ``nbytes``, if that is at most ``1 - MARGIN``; else ``"nccl"``."""
        at = self.bracket(nbytes)

        def worst(algorithm: str) -> float:
            return max(self.ratio_bound(algorithm, i) for i in at)

        wins = [a for a in SYMMETRIC if a in self.us and worst(a) <= 1 - MARGIN] if at else []
        return min(wins, key=worst, default="nccl")


@dataclass(frozen=True)
class LatencyTable:
    machine: Machine
    dtypes: Mapping[str, Latencies]
    note: str = ""

    def choose(self, nbytes: int, dtype: torch.dtype) -> str:
        """The algorithm for an all-reduce of ``nbytes`` of ``dtype`` (see the module)."""
        latencies = self.dtypes.get(dtype_name(dtype))
        return "nccl" if latencies is None else latencies.choose(nbytes)

    def largest_symmetric(self, dtype: torch.dtype) -> int:
        """The largest size :meth:`choose` reduces through symmetric memory (0: none). A
        measured size: between two, a symmetric algorithm needs to win at both."""
        latencies = self.dtypes.get(dtype_name(dtype))
        sizes = () if latencies is None else latencies.sizes
        return max((s for s in sizes if latencies.choose(s) != "nccl"), default=0)

    def to_json(self) -> dict[str, Any]:
        m = self.machine
        return {
            "schema": SCHEMA, "device": m.device, "world": m.world, "torch": m.torch,
            "nccl": m.nccl, **({"note": self.note} if self.note else {}),
            "dtypes": {d: _latencies_json(lat) for d, lat in self.dtypes.items()},
        }

    @classmethod
    def from_json(cls, obj: Any) -> LatencyTable:
        """The table in ``obj`` (parsed JSON); ``ValueError`` saying what is wrong."""
        _check(isinstance(obj, dict) and obj.get("schema") in SCHEMAS,
               f"'schema' is not one of {SCHEMAS}")
        extra = set(obj) - set(_FIELDS)
        _check(not extra, f"unknown keys {sorted(extra)}")
        for key, kind in _FIELDS.items():
            _check(isinstance(obj.get(key, "" if key == "note" else None), kind),
                   f"{key!r} must be of type {kind.__name__}")
        machine = Machine(obj["device"], obj["world"], obj["torch"], obj["nccl"])
        dtypes = {d: _latencies(d, rows) for d, rows in obj["dtypes"].items()}
        return cls(machine, dtypes, obj.get("note", ""))


_FIELDS = {"schema": int, "device": str, "world": int, "torch": str, "nccl": str, "note": str,
           "dtypes": dict}  # all required but "note"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _latencies_json(lat: Latencies) -> dict[str, Any]:
    ci = {CI_KEY: {a: [list(lo_hi) for lo_hi in v] for a, v in lat.ci.items()}} if lat.ci else {}
    return {"bytes": list(lat.sizes), **{a: list(us) for a, us in lat.us.items()}, **ci}


def _latencies(dtype: str, rows: Any) -> Latencies:
    _check(isinstance(getattr(torch, dtype, None), torch.dtype), f"unknown dtype {dtype!r}")
    _check(isinstance(rows, dict) and "bytes" in rows and "nccl" in rows,
           f"{dtype}: needs 'bytes' and 'nccl'")
    sizes = rows["bytes"]
    _check(isinstance(sizes, list) and sizes and all(isinstance(s, int) for s in sizes)
           and 0 < sizes[0] and all(a < b for a, b in zip(sizes, sizes[1:])),
           f"{dtype}: 'bytes' must be increasing positive integers")
    us = {a: v for a, v in rows.items() if a not in ("bytes", CI_KEY)}
    for a, v in us.items():
        _check(a in ALGORITHMS, f"{dtype}: unknown algorithm {a!r} (known: {ALGORITHMS})")
        _check(isinstance(v, list) and len(v) == len(sizes)
               and all(isinstance(t, (int, float)) and t > 0 for t in v),
               f"{dtype}: {a!r} must hold a positive latency per size")
    ci = rows.get(CI_KEY, {})
    _check(isinstance(ci, dict), f"{dtype}: {CI_KEY!r} must map algorithms to intervals")
    for a, v in ci.items():
        _check(a in SYMMETRIC and a in us, f"{dtype}: {CI_KEY!r} of {a!r}: not a measured "
               f"symmetric algorithm")
        _check(isinstance(v, list) and len(v) == len(sizes)
               and all(isinstance(x, list) and len(x) == 2
                       and all(isinstance(t, (int, float)) for t in x) and 0 < x[0] <= x[1]
                       for x in v),
               f"{dtype}: {CI_KEY!r} of {a!r} must hold an interval [low, high] per size")
    return Latencies(tuple(sizes), {a: tuple(map(float, v)) for a, v in us.items()},
                     {a: tuple((float(lo), float(hi)) for lo, hi in v) for a, v in ci.items()})


def cache_dir() -> Path:
    """``$RECPIPE_ALL_REDUCE_CACHE``, else ``$XDG_CACHE_HOME/recpipe/all_reduce`` (XDG's
    default: ``~/.cache``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "recpipe" / "all_reduce"


def cache_path(machine: Machine) -> Path:
    return cache_dir() / f"{machine.key}.json"


def read_table(path: Path | Traversable) -> LatencyTable:
    """The table in the file ``path``: ``ValueError`` naming the file and the fix if it is not
    one (bad JSON or schema)."""
    try:
        return LatencyTable.from_json(json.loads(path.read_text()))
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"{path}: not a valid all-reduce latency table ({e}); delete it, or "
                         "rewrite it with scripts/bench_allreduce.py --write-table") from None


def write_table(table: LatencyTable, path: Path) -> None:
    """Write ``table`` to ``path`` (atomically: readers see the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    tmp.replace(path)


def load_table(machine: Machine) -> LatencyTable | None:
    """The cached table of ``machine``, else the shipped one for its GPU and world size, else
    None. Read once per process and path."""
    return _load(cache_path(machine), machine)


def shipped_path(machine: Machine) -> Traversable:
    """Where the package ships a table for ``machine``'s GPU and world size (if it does)."""
    return resources.files(__package__) / SHIPPED / machine.shipped_name


@functools.cache
def _load(cached: Path, machine: Machine) -> LatencyTable | None:
    shipped = shipped_path(machine)
    path = cached if cached.is_file() else shipped if shipped.is_file() else None
    if path is None:
        return None
    table = read_table(path)
    found = table.machine[:2]
    if found != machine[:2]:
        raise ValueError(f"{path}: holds a table for {found}, not {machine[:2]}; delete it, or "
                         "rewrite it with scripts/bench_allreduce.py --write-table")
    return table
