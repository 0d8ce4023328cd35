"""scripts/train.py as users run it: SIGINT/SIGTERM save and say how to resume (on 2 ranks too,
every rank stopping at one step), and every checkpoint directory it refuses gets one line, a
non-zero exit and an untouched ``latest``."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint import RUN, _history, _sums_ok, latest_state, made, refusal  # noqa: F401 (made)
from test_train import SYNTHETIC, ROOT, config, gloo, losses  # noqa: F401 (gloo: a fixture)

from recpipe.train.config import composition_error
from recpipe.train.trainer import train

SCRIPT = str(ROOT / "scripts/train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _popen(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, **kwargs)


def test_sigint_finishes_the_step_saves_and_prints_how_to_resume(gloo, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run = ["trainer.steps=150", "trainer.log_interval=1", "trainer.eval=false",
           f"trainer.checkpoint_dir={ck}", f"output_dir={tmp_path / 'out'}"]
    # as a terminal's foreground job: SIGINT not ignored (a CI shell's background jobs ignore it)
    p = _popen([sys.executable, SCRIPT, *SYNTHETIC, *run], cwd=tmp_path,
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stderr.readline()
    assert first.startswith("run dir: "), first + p.communicate()[1]
    time.sleep(0.3)  # a few steps
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    *progress, last = err.splitlines()
    assert out == "" and progress[0].startswith("step 1/150: loss "), err  # off a terminal: lines
    assert all(x.startswith("step ") for x in progress), err  # and no traceback
    m = re.fullmatch(r"interrupted \(SIGINT\) after step (\d+): checkpoint (\S+); resume with: (.+)",
                     last)
    assert m, err
    step = int(m[1])
    assert 0 < step < 150 and m[2] == str(ck / f"step_{step}")
    assert (ck / "latest").read_text() == str(step) and _sums_ok(ck / f"step_{step}")
    command = shlex.split(m[3])  # run as printed: the recpipe-torchrun test below
    assert command[:2] == [sys.executable, SCRIPT] and command[-1] == "trainer.resume=true"
    reference = train(config(*run[:3], "trainer.checkpoint=false", f"trainer.steps={step}"), gloo,
                      str(tmp_path / "ref"))
    assert _history(ck) == losses(reference)  # the steps saved are an uninterrupted run's


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of torchrun worker ``rank`` (a child of ``parent``)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} under {parent}")


def _started(command: list[str], tmp_path: Path, ready: str) -> tuple[subprocess.Popen, list[str]]:
    """``command`` in its own session (stdout and stderr one pipe), once it printed a line
    starting with ``ready``."""
    p = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=ENV, start_new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith(ready):
            return p, seen
    raise AssertionError("".join(seen))


def _stopped(p: subprocess.Popen, seen: list[str], signame: str, ck: Path) -> list[str]:
    """The resume command of a 2-rank run that stopped on ``signame`` with one line, the last,
    after progress lines only (no report, no library's warning), both ranks having saved."""
    output = "".join(seen) + p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.Signals[signame], output
    *before, last = output.splitlines()
    m = re.fullmatch(rf"interrupted \({signame}\) after step (\d+): checkpoint \S+; resume with: (.+)", last)
    assert m and all(x.startswith(("resumed from ", "run dir: ", "step ")) for x in before), output
    d = ck / f"step_{m[1]}"
    assert (ck / "latest").read_text() == m[1] and _sums_ok(d)
    assert {"__0_0.distcp", "__1_0.distcp"} <= {x.name for x in d.iterdir()}  # both ranks saved
    assert json.loads((d / "meta.json").read_text())["world_size"] == 2
    return shlex.split(m[2])


def test_recpipe_torchrun_stops_on_a_signal_with_one_line_and_resumes_as_printed(tmp_path: Path) -> None:
    """recpipe-torchrun, 2 ranks: SIGTERM to rank 1 alone stops both at one step (143); the
    printed command resumes (no library warning at its rows), and Ctrl-C (SIGINT to the
    terminal's process group: the launcher and both ranks) stops that run too (130)."""
    ck = tmp_path / "ck"
    launcher = [sys.executable, "-m", "recpipe.train.torchrun", "--standalone", "--nproc-per-node=2"]
    p, seen = _started([*launcher, SCRIPT, *SYNTHETIC, "trainer.steps=5000", "trainer.log_interval=10",
                        "trainer.eval=false", f"trainer.checkpoint_dir={ck}", f"output_dir={tmp_path / 'out'}"],
                       tmp_path, "run dir: ")
    time.sleep(0.5)
    os.kill(_rank_pid(p.pid, 1), signal.SIGTERM)  # rank 1 only: rank 0 must stop with it
    command = _stopped(p, seen, "SIGTERM", ck)
    assert command[:len(launcher) + 1] == [*launcher, SCRIPT] and command[-1] == "trainer.resume=true"
    p, seen = _started(command, tmp_path, "step ")  # a row logged after the resume
    os.killpg(p.pid, signal.SIGINT)
    assert _stopped(p, seen, "SIGINT", ck) == command


# refused: one line, exit status 1, `latest` as it was (every case in-process: test_checkpoint)


@pytest.mark.parametrize("case", ["corrupt", "in use"])
def test_refused_with_one_line_exit_1_and_latest_untouched(made: Path, tmp_path: Path, case: str) -> None:
    ck, overrides, message, release = refusal(made, tmp_path, case)
    before = latest_state(ck)
    try:
        r = subprocess.run(
            [sys.executable, SCRIPT, *SYNTHETIC, *RUN, *overrides, f"trainer.checkpoint_dir={ck}",
             f"output_dir={tmp_path / 'out'}"],
            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
        )
    finally:
        release()
    assert r.returncode == 1
    assert (r.stdout + r.stderr).splitlines() == [r.stderr.strip()], r.stderr  # one line
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert latest_state(ck) == before and not (tmp_path / "out").exists()


# a key Hydra cannot compose: one line naming the override and the fix (Hydra's own: 6-20 lines)

COMPOSE_ERRORS = {
    "trainer.stpes=3": "Could not override 'trainer.stpes': Key 'stpes' not in 'TrainerConfig' "
                       "(the keys and types: recpipe.train.config)",
    "trainer.steps=abc": "Error merging override trainer.steps=abc: Value 'abc' of type 'str' could "
                         "not be converted to Integer",
    "model=nope": "In 'train': Could not find 'model/nope': pick one of dense_heavy, large, "
                  "movielens, small, tiny",
    "+foo=1": "no top-level config key 'foo': the keys are data, hardware, model, output_dir, "
              "pipeline, sharding, trainer",
}


def test_overrides_hydra_cannot_compose_get_one_line() -> None:
    for override, message in COMPOSE_ERRORS.items():
        error = composition_error(str(ROOT / "configs"), "train", [override])
        assert error is not None and error.startswith(message), error
    assert composition_error(str(ROOT / "configs"), "train", ["trainer.steps=3", "data=synthetic"]) is None
    r = subprocess.run([sys.executable, SCRIPT, "trainer.stpes=3"], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"error: {COMPOSE_ERRORS['trainer.stpes=3']}\n")
