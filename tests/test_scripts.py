"""The scripts the GPU runs depend on: compare_metrics.py (the check that decides "losses
identical"), and the two benchmarks end to end on CPU (tiny sizes: they must not break before a
device call, where time is scarce)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


def test_bench_pipeline_runs_every_dense_allreduce_variant(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = _run(str(SCRIPTS / "bench_pipeline.py"), "--config=tiny", "--nproc=1", "--repeats=1",
             "--warmup=1", "--steps=3", "--pipelines=torchrec,recpipe,recpipe_nccl_ar,recpipe_auto_ar",
             f"--data-dir={tmp_path}", f"--json={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "losses bit-identical across all 4 runs: True" in r.stdout
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["torchrec", "recpipe", "recpipe_nccl_ar", "recpipe_auto_ar"]
    assert all(len(rs[0]["ms"]) == 3 for rs in runs.values())


def test_bench_allreduce_prints_a_row_per_variant(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    r = _run("-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
             str(SCRIPTS / "bench_allreduce.py"), "--sizes=4K", "--dtypes=float32",
             "--iters=2", "--warmup=1", f"--json={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["variant"] for x in rows] == ["nccl", "compiled"] and rows[0]["vs_nccl"] == 1.0


def test_plot_allreduce_shows_auto_never_above_nccl_on_the_shipped_table(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_allreduce.py"), "--plot",
                        str(tmp_path / "ar.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [x.split(" | ") for x in r.stdout.splitlines()
            if x.startswith("| ") and ("MiB" in x or "KiB" in x)]
    picks = {row[0].strip("| "): (row[4], float(row[5].strip(" x|"))) for row in rows}
    assert picks["1 MiB"][0] == "nccl" and picks["2 MiB"][0] == "two_shot"
    assert picks["16 MiB"][0] == "two_shot" and picks["64 MiB"][0] == "nccl"
    assert all(ratio <= 1.0 for _, ratio in picks.values()) and len(picks) == 8
    assert (tmp_path / "ar.png").stat().st_size > 10_000
