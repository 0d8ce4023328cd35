"""The scripts the GPU runs depend on: compare_metrics.py (the check that decides "losses
identical"), and the two benchmarks end to end on CPU (tiny sizes: they must not break before a
device call, where time is scarce)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "compare_metrics.py"


def _metrics(path: Path, losses: list[float]) -> str:
    rows = [dict(step=i + 1, loss=x, last_loss=x, samples_per_s=100.0) for i, x in enumerate(losses)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("other", "rtol", "ok"),
    [
        ([1.0, 0.5, 0.25], "0", True),
        ([1.0, 0.5, 0.25 * (1 + 1e-7)], "0", False),  # bit-identity asked: any difference fails
        ([1.0, 0.5, 0.25 * (1 + 1e-7)], "1e-5", True),
        ([1.0, 0.5, 0.25 * (1 + 1e-4)], "1e-5", False),
        ([1.0, 0.5, float("nan")], "1e-5", False),
        ([1.0, 0.5], "1e-5", False),  # different steps
    ],
)
def test_compare_metrics(tmp_path: Path, other: list[float], rtol: str, ok: bool) -> None:
    a = _metrics(tmp_path / "a.jsonl", [1.0, 0.5, 0.25])
    b = _metrics(tmp_path / "b.jsonl", other)
    rc = subprocess.run([sys.executable, str(SCRIPT), a, b, "--rtol", rtol], capture_output=True).returncode
    assert (rc == 0) == ok


def _run(*args: str, compile: bool = True) -> subprocess.CompletedProcess:
    """``python *args``; ``compile=False``: torch.compile off (TORCHDYNAMO_DISABLE), where the
    test checks a script's wiring and test_data_parallel.py / test_all_reduce.py the compiled
    code (each compile costs CI's 2 cores ~30 s)."""
    env = {**os.environ, **({} if compile else {"TORCHDYNAMO_DISABLE": "1"})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)


def test_profile_host_compares_two_pipelines() -> None:
    r = _run(str(SCRIPTS / "profile_host.py"), "--config=tiny", "--pipelines=torchrec,recpipe_ring",
             "--warmup=2", "--steps=3", "--rows=5", compile=False)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["torchrec", "recpipe_ring"]
    assert "Python calls/step" in lines[1] and "second - first" in lines[2] and len(lines) == 8


def test_bench_pipeline_runs_the_anchors_and_a_dense_allreduce_variant(tmp_path: Path) -> None:
    """Two anchors (torchrec's SparseDist and SparseDistLite; Base is built as SparseDist is)
    and recpipe with its bucketed dense all-reduce run side by side; their runs make the
    memory-time plane (plot_pareto.py).
    (The other all-reduce variants differ only in BucketedAllReduce's arguments, which
    test_data_parallel.py and test_all_reduce.py cover, eager and compiled.)"""
    out = tmp_path / "r.json"
    names = ["torchrec", "torchrec_lite", "recpipe_nccl_ar"]
    r = _run(str(SCRIPTS / "bench_pipeline.py"), "--config=tiny", "--nproc=1", "--repeats=1",
             "--warmup=1", "--steps=3", f"--pipelines={','.join(names)}",
             f"--data-dir={tmp_path}", f"--json={out}", compile=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "losses bit-identical across all 3 runs: True" in r.stdout
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == names
    assert all(len(rs[0]["ms"]) == 3 for rs in runs.values())
    host, wait = runs["torchrec"][0]["host_ms"], runs["torchrec"][0]["wait_ms"]
    assert len(host) == len(wait) == 3 and 0 < sum(wait) < sum(host)  # the input dist's wait
    plane = subprocess.run([sys.executable, str(SCRIPTS / "plot_pareto.py"), str(out), "--plot",
                            str(tmp_path / "p.png")], capture_output=True, text=True, timeout=120)
    assert plane.returncode == 0, plane.stderr
    rows = [x for x in plane.stdout.splitlines() if x.startswith("| torchrec_lite ")]
    assert len(rows) == 1 and rows[0].endswith("x |")  # CPU runs are timed: a ratio column
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_bench_pipeline_leaves_the_cuda_trace_off() -> None:
    """The bench reports whether the CUDA sanitizer ran without importing
    ``torch.cuda._sanitizer``: the import alone puts a Python callback on every CUDA allocation,
    event and sync, which made host-bound GPU runs 2-5x slower per step."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(SCRIPTS / 'bench_pipeline.py')!r})\n"
        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)\n"
        "print(b.sanitizer_on(), 'torch.cuda._sanitizer' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False"]


def _csan(mode: str, *path: Path) -> subprocess.CompletedProcess:
    code = ("import torch.cuda._sanitizer as s\n"
            "print(s.ArgumentHandler._handle_argument.__name__, s.EventHandler._handle_kernel_launch.__name__)")
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "CSAN_NULL": mode, "PYTHONPATH": os.pathsep.join(
        [str(SCRIPTS / "csan"), *map(str, path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_csan_sitecustomize_wraps_the_sanitizer_or_names_the_fix(tmp_path: Path) -> None:
    """scripts/csan: under the sanitizer, its handlers wrap torch's (the wrapped names stay as
    long as torch's do, so a torch that renames them fails here, not on the GPU); the next
    sitecustomize on the path (a kit's) runs once, also with csan's folder on the path twice; a
    bad mode is one line."""
    (tmp_path / "sitecustomize.py").write_text("print('next sitecustomize ran')\n")
    r = _csan("skip", SCRIPTS / "csan" / ".." / "csan", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["next sitecustomize ran", "_argument _kernel_launch"], r.stdout
    assert "CSAN_NULL=skip pid" in r.stderr and "skipped 0 null-pointer" in r.stderr
    r = _csan("keep")
    assert r.returncode == 2 and r.stderr.strip() == "CSAN_NULL=keep: use CSAN_NULL=skip or CSAN_NULL=log"


def _script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (its ``main()`` not run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _faked_runs(monkeypatch: pytest.MonkeyPatch, result: Callable[[str], dict]) -> ModuleType:
    """bench_pipeline with each run faked: it writes ``result(pipeline)`` plus the fields every
    run has (1 ms per step, no memory, 1 MiB of KJTs, world 1)."""
    bench = _script("bench_pipeline")

    def run(cmd: list[str], check: bool) -> None:
        arg = dict(x[2:].split("=", 1) for x in cmd if x.startswith("--") and "=" in x)
        res = dict(ms=[1.0], alloc=0.0, reserved=0.0, retries=0, growth=0.0, ring=0.0,
                   kjt_mib=1.0, world=1, **result(arg["run-one"]))
        Path(arg["result"]).write_text(json.dumps(res))

    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=run))
    return bench


def test_bench_pipeline_time_limit_keeps_the_runs_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``--time-limit``: no run starts that would end after it, judged by the longest run so
    far; the table and the JSON cover the runs done. Runs are faked (each writes its result and
    moves a fake clock by 1 s), so that which runs fit is exact. The title names the allocator's
    settings where they are set."""
    clock = [0.0]

    def result(name: str) -> dict:
        clock[0] += 1.0
        return dict(losses=[0.5], device="cpu")

    bench = _faked_runs(monkeypatch, result)
    monkeypatch.setattr(bench, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_pipeline.py", "--config=tiny", "--repeats=3", "--pipelines=torchrec,recpipe",
        "--time-limit=3.5", f"--data-dir={tmp_path}", f"--json={out}"])
    bench.main()  # runs end at 1, 2, 3 s; a 4th would end at 4 s
    printed = capsys.readouterr().out
    assert "--time-limit 3.5 s: no run 2 of recpipe or later" in printed
    saved = json.loads(out.read_text())
    assert {n: len(rs) for n, rs in saved["runs"].items()} == {"torchrec": 2, "recpipe": 1}
    assert "alternating runs (torchrec 2, recpipe 1)" in saved["title"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;" in saved["title"]
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py", "--time-limit=0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--time-limit must be > 0 seconds" in capsys.readouterr().err


GPU = "NVIDIA H200"


@pytest.mark.parametrize("losses, device, repeats, exits", [
    ({"torchrec": [[0.5]], "recpipe": [[0.5]]}, GPU, 2, False),
    ({"torchrec": [[0.5]], "recpipe": [[0.25]]}, GPU, 2, True),  # each repeats itself: it tells
    ({"torchrec": [[0.5], [0.75]], "recpipe": [[0.25]]}, GPU, 2, False),  # run-to-run noise
    ({"torchrec": [[0.5]], "recpipe": [[0.25]]}, GPU, 1, False),  # one run each cannot tell
    ({"torchrec": [[0.5]], "recpipe": [[0.25]]}, "cpu", 1, True),  # the CPU is deterministic
])
def test_bench_pipeline_fails_only_where_losses_can_tell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
    losses: dict[str, list[list[float]]], device: str, repeats: int, exits: bool,
) -> None:
    """The bench exits non-zero where the pipelines' losses differ and the losses can tell: on
    the CPU, with --deterministic, or where each pipeline repeats its own over 2 runs or more.
    Else (GPU runs without --deterministic) it says why it cannot tell and exits 0."""
    runs_left = {n: list(ls) for n, ls in losses.items()}

    def result(name: str) -> dict:
        mine = runs_left[name]
        return dict(losses=mine.pop(0) if len(mine) > 1 else mine[0], device=device)

    bench = _faked_runs(monkeypatch, result)
    monkeypatch.setattr(sys, "argv", [
        "bench_pipeline.py", "--config=tiny", f"--repeats={repeats}", "--pipelines=torchrec,recpipe",
        f"--data-dir={tmp_path}"])
    if exits:
        with pytest.raises(SystemExit, match="losses differ between pipelines"):
            bench.main()
    else:
        bench.main()
    noted = "cannot tell the pipelines apart" in capsys.readouterr().out
    assert noted == (not exits and losses["torchrec"] != losses["recpipe"])


def test_plot_pareto_memory_only_and_tax_share(tmp_path: Path) -> None:
    """Shared-GPU runs plot memory only; the tax share is (torchrec - x) / (torchrec - base)."""
    run = lambda ms, mib: dict(ms=[ms], reserved=mib, device="H100 (ranks share it, gloo)")  # noqa: E731
    saved = {"title": "t", "runs": {"torchrec": [run(1.0, 300)], "torchrec_base": [run(2.0, 100)],
                                    "recpipe": [run(1.0, 150)]}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(saved))
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_pareto.py"), str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| recpipe | 1 | 150 (150-150) | 75% |" in r.stdout and "ms/iter" not in r.stdout
    bad = subprocess.run([sys.executable, str(SCRIPTS / "plot_pareto.py"), str(tmp_path / "no.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error:")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bench_allreduce_prints_a_row_per_variant(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    r = _run("-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
             str(SCRIPTS / "bench_allreduce.py"), "--sizes=4K", "--dtypes=float32",
             "--iters=2", "--warmup=1", f"--json={out}", compile=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [x["variant"] for x in rows] == ["nccl", "auto"] and rows[0]["vs_nccl"] == 1.0
    # what --table-from needs besides the rows (NCCL's version on CUDA alone)
    assert result["device"] == "cpu" and result["iters"] == 2 and result["torch"] and "nccl" not in result


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plot_allreduce_shows_auto_never_above_nccl_on_the_shipped_table(tmp_path: Path, dtype: str) -> None:
    """The shipped 2 x H200 table (200 calls per size, each dtype measured): NCCL to 1 MiB and at
    64 MiB, two-shot from 2 to 16 MiB, where its ratio's 95% interval lies below 1."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_allreduce.py"), "--dtype", dtype, "--plot",
                        str(tmp_path / "ar.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2].endswith("| one_shot / NCCL, 95% | two_shot / NCCL, 95% |")  # schema 2
    rows = [x.split(" | ") for x in lines if x.startswith("| ") and ("MiB" in x or "KiB" in x)]
    picks = {row[0].strip("| "): (row[4], float(row[5].strip(" x|")), row[7]) for row in rows}
    assert list(picks) == ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "2 MiB", "4 MiB", "16 MiB",
                           "64 MiB"]
    assert [picks[s][0] for s in picks] == ["nccl"] * 5 + ["two_shot"] * 3 + ["nccl"]
    assert all(ratio <= 1.0 for _, ratio, _ in picks.values())
    assert all(float(ci.strip(" |").split("-")[1]) < 1
               for pick, _, ci in picks.values() if pick == "two_shot")
    assert (tmp_path / "ar.png").stat().st_size > 10_000


def test_plot_allreduce_shows_several_dtypes_with_their_intervals(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_allreduce.py"), "--dtype", "bfloat16,float32",
                        "--plot", str(tmp_path / "ar.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [x for x in r.stdout.splitlines() if x.startswith("### ")] == ["### bfloat16", "### float32"]
    assert r.stdout.count("| two_shot / NCCL, 95% |") == 2
    assert (tmp_path / "ar.png").stat().st_size > 10_000


def test_memory_snapshot_analysis_self_test_and_recording_without_cuda(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "memory_snapshot.py"), "--self-test"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "self-test: ok" in r.stdout, r.stderr
    from recpipe.bench.snapshot_recording import SnapshotProfiler

    prof = SnapshotProfiler(str(tmp_path / "s.pickle"))
    prof.start()  # no CUDA here: records nothing, dumps nothing
    prof.step()
    prof.stop()
    assert prof.dumped is None and not (tmp_path / "s.pickle").exists()


def test_every_script_option_has_help() -> None:
    """``--help`` documents every option of every script and tool (issue 23, case 9)."""
    import ast

    bare = []
    for path in sorted(p for d in ("scripts", "bench", "train") for p in (SCRIPTS.parent / d).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"
                    and not any(k.arg == "help" for k in node.keywords)):
                bare.append(f"{path.name}:{node.lineno}")
    assert bare == []


def test_bench_max_batch_names_the_pipelines_before_running(tmp_path: Path) -> None:
    r = _run(str(SCRIPTS / "bench_max_batch.py"), "--pipelines=torchrec,torchrecc", "--cap-mib=1",
             "--lo=1", "--hi=2", f"--data-dir={tmp_path}")
    assert r.returncode == 2 and "unknown torchrecc: pick from torchrec, " in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_exposed_comm_measures_what_no_compute_kernel_hides(tmp_path: Path) -> None:
    """All-reduce 5-25 µs against compute 0-10 and 20-30: 20 busy, 10 exposed (10-20); an
    all-to-all 28-35: 7 busy, 5 exposed; per step (2 profiled steps halve every figure)."""
    mod = _script("exposed_comm")

    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("void at::native::elementwise_kernel", 0, 10), kernel("sm90_gemm", 20, 10),
              kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 5, 20),
              kernel("ncclDevKernel_SendRecv", 28, 7),
              {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#6", "ts": 0, "dur": 40}]
    r = mod.analyse({"traceEvents": events})
    assert r == {"steps": 1.0, "compute busy": 20.0, "all-reduce busy": 20.0,
                 "all-reduce exposed": 10.0, "all-to-all busy": 7.0, "all-to-all exposed": 5.0,
                 "GPU span": 35.0}
    events.append({**events[-1], "name": "ProfilerStep#7", "ts": 40})
    assert mod.analyse({"traceEvents": events})["all-reduce exposed"] == 5.0
    assert mod.minus([(0, 10), (20, 30)], [(5, 22), (25, 26)]) == [(0, 5), (22, 25), (26, 30)]
    for text, said in ((json.dumps({"traceEvents": events[-2:]}), "no GPU kernels"),  # CPU only
                       ("[1, 2]", "no GPU kernels"), ("{}", "not a chrome trace"),
                       ("{bad", "not JSON")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        r = _run(str(SCRIPTS / "exposed_comm.py"), str(bad), compile=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr and said in r.stderr, r.stderr


def test_torchrec_pipeline_tests_names_the_missing_test_files(tmp_path: Path) -> None:
    """torchrec's own pipeline tests are not in its wheel: without them under ``--tests`` (no
    folder, or a folder lacking a file) one line names ``--tests`` and what to fetch, exit 2,
    before any pytest run."""
    for folder in (tmp_path / "absent", tmp_path):
        r = _run(str(SCRIPTS / "torchrec_pipeline_tests.py"), f"--tests={folder}", compile=False)
        assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --tests {folder}"), lines
        assert "torchrec's source tree at torchrec " in lines[0]
