"""recpipe.ops.all_reduce_table: the choice from measured latencies (never slower than NCCL on
them: a symmetric algorithm only where its ratio's 95% interval shows a win), the cache and the
shipped table (schema 2: 200 calls per size with intervals, bf16 and fp32 each measured; the
bench's JSON in docs/results rebuilds it), schema 1 files still read, and errors on files that are
not tables; the bench's rows and intervals, and ``--table-from``."""

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


def _table(
    sizes: list[int], machine: Machine = H200, ci: dict | None = None, **us: list[float],
) -> LatencyTable:
    latencies = Latencies(tuple(sizes), {a: tuple(t) for a, t in us.items()},
                          {a: tuple(map(tuple, v)) for a, v in (ci or {}).items()})
    return LatencyTable(machine, {"bfloat16": latencies})


def _choices(table: LatencyTable, sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> list[str]:
    return [table.choose(n, dtype) for n in sizes]


def test_shipped_h200_table_never_loses_to_nccl() -> None:
    """The 200-call measurements on 2 H200s (2026-11-28): NCCL up to 1 MiB and at 64 MiB, where
    no interval shows a win; two-shot from 2 to 16 MiB, where its interval's upper end is at most
    0.93 (bf16 4 MiB: 0.92) in both dtypes."""
    table = read_table(shipped_path(H200))
    assert table.machine[2:] == ("2.11.0+cu130", "2.28.9") and "200 interleaved calls" in table.note
    sizes = [4 * K, 16 * K, 64 * K, 256 * K, M, 2 * M, 3 * M, 4 * M, 16 * M, 32 * M, 64 * M]
    expected = ["nccl"] * 5 + ["two_shot"] * 4 + ["nccl"] * 2
    assert _choices(table, sizes) == _choices(table, sizes, torch.float32) == expected
    assert _choices(table, sizes, torch.float16) == ["nccl"] * len(sizes)  # not measured
    assert table.largest_symmetric(torch.bfloat16) == table.largest_symmetric(torch.float32) == 16 * M
    assert table.largest_symmetric(torch.float16) == 0
    bf16, fp32 = table.dtypes["bfloat16"], table.dtypes["float32"]
    assert set(bf16.ci) == set(fp32.ci) == {"one_shot", "two_shot"}  # intervals: schema 2
    assert bf16.us != fp32.us  # fp32 measured, not bf16's numbers again
    for lat in (bf16, fp32):
        for i, size in enumerate(lat.sizes):
            if lat.choose(size) != "nccl":
                assert lat.ci[lat.choose(size)][i][1] <= 0.93, size


def test_shipped_h200_table_is_the_bench_json_in_docs_results(bench: object) -> None:
    """``--table-from`` of the run's JSON (which predates its versions: given) makes the shipped
    table, note aside."""
    root = Path(__file__).resolve().parents[1]
    obj = json.loads((root / "docs/results/allreduce-200_2xH200_2026-11-28.json").read_text())
    rebuilt = bench.table_from_json(obj, ("2.11.0+cu130", "2.28.9"), 200)
    shipped = read_table(shipped_path(H200))
    assert (rebuilt.machine, rebuilt.dtypes) == (shipped.machine, shipped.dtypes)


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


def test_a_win_the_interval_does_not_show_is_nccl() -> None:
    """With intervals, their upper end decides: a P50 win whose interval reaches 1 - MARGIN (or
    beyond 1) is no win."""
    table = _table([K, 2 * K, 4 * K], nccl=[10, 10, 10], one_shot=[8, 8, 8], two_shot=[9, 9, 9],
                   ci={"one_shot": [[0.7, 0.9], [0.7, 0.98], [0.9, 1.1]],
                       "two_shot": [[0.8, 0.95], [0.85, 0.96], [0.85, 0.99]]})
    assert _choices(table, [K, 3 * K // 2, 2 * K, 3 * K, 4 * K]) == [
        "one_shot", "two_shot", "two_shot", "nccl", "nccl"]
    assert table.largest_symmetric(torch.bfloat16) == 2 * K


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


GOOD = _table([K], nccl=[10], two_shot=[5], ci={"two_shot": [[0.4, 0.6]]}).to_json()


def test_schema_2_round_trips_and_schema_1_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RECPIPE_ALL_REDUCE_CACHE", str(tmp_path))
    assert GOOD["schema"] == 2 and GOOD["dtypes"]["bfloat16"]["ratio_ci95"] == {"two_shot": [[0.4, 0.6]]}
    cache_path(H200).write_text(json.dumps(GOOD))
    assert load_table(H200).to_json() == GOOD
    legacy = {**GOOD, "schema": 1, "dtypes": {"bfloat16": {"bytes": [K], "nccl": [10], "two_shot": [5]}}}
    cache_path(H200).write_text(json.dumps(legacy))
    assert read_table(cache_path(H200)).dtypes["bfloat16"].ci == {}


@pytest.mark.parametrize("content, reason", [
    ("{not json", "Expecting property name"),
    (json.dumps({**GOOD, "schema": 3}), "'schema' is not one of (1, 2)"),
    (json.dumps({**GOOD, "world": "2"}), "'world' must be of type int"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K], "nccl": [10], "three_shot": [1]}}}),
     "unknown algorithm 'three_shot'"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K, 2 * K], "nccl": [10]}}}),
     "'nccl' must hold a positive latency per size"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [2 * K, K], "nccl": [10, 10]}}}),
     "'bytes' must be increasing"),
    (json.dumps({**GOOD, "device": "NVIDIA H100 80GB HBM3"}), "holds a table for"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K], "nccl": [10], "two_shot": [5],
                                                 "ratio_ci95": {"two_shot": [[0.6, 0.4]]}}}}),
     "'ratio_ci95' of 'two_shot' must hold an interval [low, high] per size"),
    (json.dumps({**GOOD, "dtypes": {"bfloat16": {"bytes": [K], "nccl": [10],
                                                 "ratio_ci95": {"two_shot": [[0.4, 0.6]]}}}}),
     "'ratio_ci95' of 'two_shot': not a measured symmetric algorithm"),
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


@pytest.fixture(name="bench")
def bench_fixture(monkeypatch: pytest.MonkeyPatch) -> object:
    """scripts/bench_allreduce.py as a module."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    return importlib.import_module("bench_allreduce")


def test_bench_rows_make_the_table(bench: object) -> None:
    """``--write-table``: one-shot is the slower of its eager (copy) and compiled (in place) runs,
    with the interval whose upper end is higher."""
    p50 = {"nccl": [10, 20], "symm_one_shot": [6, 30], "compiled_one_shot": [7, 25],
           "symm_two_shot": [8, 12], "auto": [7, 12]}
    ci = {"nccl": [[1, 1]] * 2, "symm_one_shot": [[0.5, 0.7], [1.4, 1.6]],
          "compiled_one_shot": [[0.6, 0.8], [1.2, 1.3]], "symm_two_shot": [[0.7, 0.9], [0.5, 0.7]],
          "auto": [[0.6, 0.8], [0.5, 0.7]]}
    records = [dict(dtype="bfloat16", bytes=n, variant=v, p50_us=us[i], ratio_ci95=ci[v][i])
               for i, n in enumerate([2 * K, K]) for v, us in p50.items()]
    table = bench.latency_table(records, H200, calls=200)
    assert table.machine == H200 and "200 interleaved calls" in table.note
    assert table.dtypes == _table([K, 2 * K], nccl=[20, 10], one_shot=[30, 7], two_shot=[12, 8],
                                  ci={"one_shot": [[1.4, 1.6], [0.6, 0.8]],
                                      "two_shot": [[0.5, 0.7], [0.7, 0.9]]}).dtypes


def test_table_from_json_takes_the_files_machine_and_says_what_is_missing(
    bench: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """``--table-from``: the table ``--write-table`` writes, from the ``--json`` rows; versions
    and calls from the file, else from the arguments; a CPU run's file, one without versions
    and no ``--versions``, or one whose rows lack intervals, is an error saying so."""
    records = [dict(dtype="bfloat16", bytes=K, variant=v, p50_us=us, ratio_ci95=ci)
               for v, us, ci in [("nccl", 10, [1, 1]), ("symm_one_shot", 6, [0.5, 0.7]),
                                 ("compiled_one_shot", 7, [0.6, 0.8]), ("symm_two_shot", 8, [0.7, 0.9]),
                                 ("auto", 7, [0.6, 0.8])]]
    old = {"world": 2, "device": "NVIDIA H200", "rows": records}
    new = {**old, "torch": H200.torch, "nccl": H200.nccl, "iters": 50}
    expected = bench.latency_table(records, H200, calls=50)
    assert bench.table_from_json(new) == expected
    assert bench.table_from_json(new, ("1", "2"), 200) == expected  # the file's own win
    assert bench.table_from_json(old, (H200.torch, H200.nccl), 50, "a.json") == LatencyTable(
        H200, expected.dtypes, expected.note + "; rebuilt by --table-from a.json")
    with pytest.raises(ValueError, match="pass --versions TORCH,NCCL"):
        bench.table_from_json(old, None, 50)
    with pytest.raises(ValueError, match="not the --json file of a CUDA run"):
        bench.table_from_json({**new, "device": "cpu"})
    with pytest.raises(ValueError, match="needs 'device', a GPU, 'world'"):  # (was a KeyError)
        bench.table_from_json({k: v for k, v in new.items() if k != "world"})
    with pytest.raises(ValueError, match="pass --iters"):  # the CLI passes None unless given
        bench.table_from_json({k: v for k, v in new.items() if k != "iters"}, None, None)
    no_intervals = [{k: v for k, v in r.items() if k != "ratio_ci95"} for r in records]
    with pytest.raises(ValueError, match="no 95% intervals"):  # (was a KeyError)
        bench.table_from_json({**new, "rows": no_intervals})
    # the CLI: no process group, the table at --table-out (or the cache path of the file's machine)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(new))
    monkeypatch.setenv("RECPIPE_ALL_REDUCE_CACHE", str(tmp_path / "cache"))
    given = tmp_path / "t.json"
    for argv, out in [([], cache_path(H200)), (["--table-out", str(given)], given)]:
        monkeypatch.setattr("sys.argv", ["bench_allreduce.py", "--table-from", str(path), *argv])
        bench.main()
        assert read_table(out).dtypes == expected.dtypes
    path.write_text(json.dumps(old))
    monkeypatch.setattr("sys.argv", ["bench_allreduce.py", "--table-from", str(path)])
    with pytest.raises(SystemExit):
        bench.main()


def test_median_interval_is_the_order_statistics_around_the_median(bench: object) -> None:
    xs = [float(x) for x in range(1, 201)]  # 200 calls: the 86th and 115th of 200
    assert bench.median_interval(xs[::-1]) == (86.0, 100.5, 115.0)
    assert bench.median_interval([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)  # few: the whole range


def test_auto_verdict_names_a_loss_and_a_missed_win(bench: object) -> None:
    def row(nbytes: int, ratio: float, lo: float, hi: float) -> dict:
        return dict(dtype="bfloat16", bytes=nbytes, variant="auto", ratio=ratio, ratio_ci95=[lo, hi])

    records = [row(4 * K, 1.01, 0.98, 1.04), row(M, 1.05, 1.02, 1.08), row(4 * M, 0.8, 0.78, 0.83),
               row(8 * M, 0.84, 0.8, 0.9), dict(row(K, 2, 2, 2), variant="nccl")]
    assert bench.auto_verdict(records, (2 * M, 16 * M), 0.85) == [
        "slower than NCCL at bfloat16 1048576 B: 1.05x [1.02, 1.08]",
        "not <= 0.85x at bfloat16 8388608 B: 0.84x [0.80, 0.90]",
    ]
