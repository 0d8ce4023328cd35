"""Every command the README shows runs: the CPU ones here (with the run directories in a
temporary folder), the rest in the test named for it. A command added to the README without a
test fails this file."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: commands run elsewhere: by CI itself, or by the test named
ELSEWHERE = {
    "bash scripts/setup_venv.sh": ".ci/run (scripts/test.sh runs it first)",
    "bash scripts/test.sh": ".ci/run",
    ".venv/bin/python examples/swap_pipeline.py": "tests/test_examples.py",
    ".venv/bin/recpipe-torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --rdzv-backend=c10d "
    "--rdzv-endpoint=HOST:PORT scripts/train.py": "tests/test_multinode.py (two such nodes)",
}


def readme_commands() -> list[str]:
    """The README's shell lines that start with ``.venv/bin/`` or ``bash`` (continuations joined,
    comments dropped)."""
    joined = re.sub(r"\\\n +", " ", README)
    lines = re.findall(r"^    ((?:\.venv/bin/|bash ).*)$", joined, re.M)
    return [" ".join(re.sub(r"\s+#.*$", "", x).split()) for x in lines]


def test_every_readme_command_is_run_somewhere() -> None:
    commands = readme_commands()
    assert ".venv/bin/python scripts/train.py" in commands
    here = {c for c in commands if c.startswith((".venv/bin/python scripts/train.py",
                                                 ".venv/bin/recpipe-torchrun --standalone"))}
    assert set(commands) - here - set(ELSEWHERE) == set(), "a README command without a test"


def _run(command: str, tmp: Path) -> subprocess.CompletedProcess:
    """The command from the repository root, its run directories under ``tmp``; one that sets
    no ``trainer.steps`` trains 50 (CI's time: its options and data are what it tests)."""
    args = shlex.split(command.replace("trainer.checkpoint_dir=ck", f"trainer.checkpoint_dir={tmp / 'ck'}"))
    args[0] = str(ROOT / args[0])
    args.append(f"output_dir={tmp / 'out'}")
    if "trainer.steps=" not in command:
        args.append("trainer.steps=50")
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("command", [c for c in readme_commands() if c not in ELSEWHERE
                                     and "trainer.checkpoint_dir=ck" not in c])
def test_readme_command_runs(command: str, tmp_path: Path) -> None:
    r = _run(command, tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "done: loss" in r.stdout + r.stderr


def _pasted(stderr: str) -> list[str]:
    """The command that the last line of ``stderr`` says resumes the run (after ``resume with:``)."""
    last = stderr.strip().splitlines()[-1]
    assert "resume with: " in last, last
    return shlex.split(last.split("resume with: ", 1)[1])


def test_readme_stop_and_resume_commands(tmp_path: Path) -> None:
    """The README's stop: its last line names the checkpoint and a command to paste, which is
    the README's resume line (this interpreter, the run's own output_dir) and resumes."""
    stop, resume = [c for c in readme_commands() if "trainer.checkpoint_dir=ck" in c]
    first = _run(stop, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped after step 20 of 40 (trainer.stop_after): checkpoint " in first.stderr
    pasted = _pasted(first.stderr)
    ck = tmp_path / "ck"
    assert " ".join(pasted).endswith(f"trainer.checkpoint_dir={ck} trainer.resume=true"), pasted
    assert not any(a.startswith("trainer.stop_after") for a in pasted), pasted
    readme = shlex.split(resume.replace("trainer.checkpoint_dir=ck", f"trainer.checkpoint_dir={ck}"))
    assert Path(pasted[0]).samefile(ROOT / readme[0]), pasted  # this environment's interpreter
    assert [a for a in pasted if not a.startswith("output_dir=")][1:] == readme[1:], (pasted, resume)
    second = subprocess.run(pasted, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {ck / 'step_20'}" in second.stderr
    assert (ck / "latest").read_text().strip() == "40"
