"""scripts/compare_metrics.py: the check that decides "losses identical" in the GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_metrics.py"


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
