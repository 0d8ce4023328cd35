"""The README's "Use it in your job" example runs as written, and the swap changes no loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dist_utils import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "swap_pipeline.py"


def _start(pipeline: str, steps: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["MASTER_PORT"] = str(free_port())
    env["CUDA_VISIBLE_DEVICES"] = ""  # the example is the CPU job
    env["OMP_NUM_THREADS"] = "1"  # the two runs side by side
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), f"--pipeline={pipeline}", f"--steps={steps}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _losses(proc: subprocess.Popen, steps: int) -> list[str]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    losses = re.findall(r"^step \d+ loss (\S+)$", out, flags=re.MULTILINE)
    assert len(losses) == steps, out
    return losses


def test_swap_example_losses_match_torchrec() -> None:
    steps = 5
    procs = {p: _start(p, steps) for p in ("recpipe", "torchrec")}  # side by side
    ours, theirs = (_losses(procs[p], steps) for p in ("recpipe", "torchrec"))
    assert ours == theirs  # printed with repr: bit for bit
    assert all(float(x) > 0 for x in ours)


def test_readme_snippet_is_the_example() -> None:
    """The README's "The one-line swap" snippet is made of the example's own lines."""
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    section = readme[readme.index("## The one-line swap"):]
    snippet = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    example = {line.strip() for line in EXAMPLE.read_text().splitlines()}
    lines = [line.strip() for line in snippet.splitlines() if line.strip()]
    assert "from recpipe.pipeline import TrainPipelineSparseDist  # the one-line swap" in lines
    assert [line for line in lines if line not in example] == []
