"""recpipe.ops.all_reduce_table: the choice from measured latencies (never slower than NCCL on
them), the cache and the shipped table, and errors on files that are not tables."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from recpipe.ops.all_reduce_table import (
    Latencies,
    LatencyTable,
    Machine,
    cache_dir,
    cache_path,
    load_table,
    read_table,
    shipped_path,
    write_table,
)

K, M = 1 << 10, 1 << 20
H200 = Machine("NVIDIA H200", 2, "2.13.0+cu130", "2.27.7")


def _table(sizes: list[int], machine: Machine = H200, **us: list[float]) -> LatencyTable:
    return LatencyTable(machine, {"bfloat16": Latencies(tuple(sizes), {a: tuple(t) for a, t in us.items()})})


def _choices(table: LatencyTable, sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> list[str]:
    return [table.choose(n, dtype) for n in sizes]


def test_shipped_h200_table_never_loses_to_nccl() -> None:
    """The issue's measurements: NCCL up to 1 MiB and at 64 MiB, two-shot from 2 to 16 MiB."""
    table = read_table(shipped_path(H200))
    sizes = [4 * K, 64 * K, 256 * K, M, 2 * M, 3 * M, 4 * M, 16 * M, 32 * M, 64 * M]
    expected = ["nccl"] * 4 + ["two_shot"] * 4 + ["nccl"] * 2
    assert _choices(table, sizes) == _choices(table, sizes, torch.float32) == expected
    assert _choices(table, sizes, torch.float16) == ["nccl"] * len(sizes)  # not measured
    assert table.largest_symmetric(torch.bfloat16) == 16 * M
    assert table.largest_symmetric(torch.float16) == 0


def test_a_symmetric_algorithm_must_win_at_both_neighbours() -> None:
    table = _table([K, 4 * K, 16 * K], nccl=[10, 10, 10], one_shot=[5, 5, 20])
    assert _choices(table, [K, 2 * K, 4 * K, 8 * K, 16 * K]) == ["one_shot"] * 3 + ["nccl"] * 2
    assert table.largest_symmetric(torch.bfloat16) == 4 * K


def test_a_win_below_the_margin_is_nccl() -> None:
    table = _table([K, 2 * K], nccl=[10, 10], one_shot=[9.8, 9.6])  # 2% and 4% faster
    assert _choices(table, [K, 2 * K]) == ["nccl", "one_shot"]


def test_the_best_worst_case_ratio_wins() -> None:
    table = _table([K, 2 * K], nccl=[10, 10], one_shot=[5, 9], two_shot=[8, 8])
    assert _choices(table, [K, 3 * K // 2, 2 * K]) == ["one_shot", "two_shot", "two_shot"]


def test_outside_the_measurements_is_nccl() -> None:
    table = _table([2 * K, 4 * K], nccl=[10, 10], two_shot=[1, 1])
    assert _choices(table, [K, 2 * K, 4 * K, 4 * K + 4]) == ["nccl", "two_shot", "two_shot", "nccl"]
    assert _choices(table, [2 * K], torch.float32) == ["nccl"]  # a dtype not measured


def test_cache_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RECPIPE_ALL_REDUCE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache/recpipe/all_reduce"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg/recpipe/all_reduce"
    monkeypatch.setenv("RECPIPE_ALL_REDUCE_CACHE", str(tmp_path / "mine"))
    assert cache_path(H200) == tmp_path / "mine/NVIDIA_H200-w2-torch2.13.0+cu130-nccl2.27.7.json"


def test_the_cache_comes_before_the_shipped_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RECPIPE_ALL_REDUCE_CACHE", str(tmp_path))
    measured = _table([K, 2 * K], nccl=[10, 10], one_shot=[5, 5])
    write_table(measured, cache_path(H200))
    assert load_table(H200) == measured
    other_versions = H200._replace(nccl="2.28.3")  # not measured: the shipped table
    assert load_table(other_versions) == read_table(shipped_path(H200))
    assert load_table(H200._replace(device="NVIDIA H100 80GB HBM3")) is None
    assert load_table(H200._replace(world=4)) is None


GOOD = _table([K], nccl=[10], two_shot=[5]).to_json()


@pytest.mark.parametrize("content, reason", [
    ("{not json", "Expecting property name"),
    (json.dumps({**GOOD, "schema": 2}), "'schema' is not 1"),
    (json.dumps({**GOOD, "world": "2"}), "'world' must be of type int"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K], "nccl": [10], "three_shot": [1]}}}),
     "unknown algorithm 'three_shot'"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K, 2 * K], "nccl": [10]}}}),
     "'nccl' must hold a positive latency per size"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [2 * K, K], "nccl": [10, 10]}}}),
     "'bytes' must be increasing"),
    (json.dumps({**GOOD, "device": "NVIDIA H100 80GB HBM3"}), "holds a table for"),
])
def test_a_file_that_is_not_the_table_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str, reason: str,
) -> None:
    monkeypatch.setenv("RECPIPE_ALL_REDUCE_CACHE", str(tmp_path))
    cache_path(H200).write_text(content)
    with pytest.raises(ValueError) as e:
        load_table(H200)
    message = str(e.value)
    assert reason in message and str(cache_path(H200)) in message and "\n" not in message
    assert "delete it, or rewrite it with scripts/bench_allreduce.py --write-table" in message


def test_bench_rows_make_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--write-table``: one-shot is the slower of its eager (copy) and compiled (in place) runs."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    bench = importlib.import_module("bench_allreduce")
    p50 = {"nccl": [10, 20], "symm_one_shot": [6, 30], "compiled_one_shot": [7, 25],
           "symm_two_shot": [8, 12], "compiled": [7, 12]}
    records = [dict(dtype="bfloat16", bytes=n, variant=v, p50_us=us[i])
               for i, n in enumerate([2 * K, K]) for v, us in p50.items()]
    table = bench.latency_table(records, H200)
    assert table.machine == H200
    assert table.dtypes == _table([K, 2 * K], nccl=[20, 10], one_shot=[30, 7], two_shot=[12, 8]).dtypes
