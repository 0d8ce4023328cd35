"""When a run fails: a failing evaluation keeps the training (the last step is saved before its
evaluation; at world size 1 any failure after a step saves that step), an unexpected exception
is one ``error:`` line naming the log file with its traceback, a config error loads no torch,
and under torchrun recpipe-torchrun ends with our line and the failing rank's status (plain
torchrun's report names our line as the root cause)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from test_train import ROOT, SYNTHETIC, _rows, config, gloo, losses  # noqa: F401 (gloo: a fixture)

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from recpipe.train import trainer
from recpipe.train.torchrun import _root
from recpipe.train.config import UsageError
from recpipe.train.trainer import RunFailed, train

SCRIPT = str(ROOT / "scripts/train.py")


def test_a_failure_after_a_step_saves_that_step_and_the_resume_logs_the_same_rows(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At world size 1: the evaluation at step 7 fails (off a log boundary: rows every 5 steps);
    step 7 is saved with the steps since the last row, and the resumed run logs the training
    rows of a run that never failed."""
    evaluate = trainer._Trainer._evaluate

    def failing(self, step, *args):
        if step == 7:
            raise RuntimeError("eval exploded")
        return evaluate(self, step, *args)

    monkeypatch.setattr(trainer._Trainer, "_evaluate", failing)
    ck = tmp_path / "ck"
    common = ("trainer.steps=12", "trainer.log_interval=5", f"trainer.checkpoint_dir={ck}")
    with pytest.raises(RunFailed) as e:
        train(config(*common, "trainer.eval_interval=7"), gloo, str(tmp_path / "a"))
    assert str(e.value.__cause__) == "eval exploded"
    assert e.value.run_dir == str(tmp_path / "a")
    assert e.value.checkpoint == (str(ck / "step_7"), str(ck))
    assert (ck / "latest").read_text() == "7"
    monkeypatch.undo()
    rest = train(config(*common, "trainer.resume=true"), gloo, str(tmp_path / "b"))
    reference = train(config(*common[:2], "trainer.checkpoint=false"), gloo, str(tmp_path / "ref"))
    assert [s for s, _, _ in losses(rest)] == [10, 12]
    written = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert _rows(written) == _rows(reference)  # the failed evaluation's row aside: none


# a subprocess of scripts/train.py whose trainer's evaluation fails

FAILING_EVAL = (
    "import runpy, sys\n"
    "from recpipe.train import trainer\n"
    "def failing(*args):\n"
    "    raise RuntimeError('eval exploded')\n"
    "trainer._Trainer._evaluate = failing\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_the_final_evaluation_failing_keeps_the_final_checkpoint_and_prints_one_line(
    tmp_path: Path,
) -> None:
    r = subprocess.run(
        [sys.executable, "-c", FAILING_EVAL, SCRIPT, *SYNTHETIC, "trainer.steps=20",
         "trainer.log_interval=10", f"output_dir={tmp_path / 'out'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 1, r.stderr
    (run,) = (tmp_path / "out").iterdir()
    log = run / "error-rank0.log"
    m = re.fullmatch(
        re.escape(f"error: RuntimeError: eval exploded (the traceback is in {log}; RECPIPE_TRACEBACK=1 "
                  f"prints it here); the last checkpoint is {run / 'checkpoint' / 'step_20'}, resume "
                  "with: ") + r"(\S+) " + re.escape(
                      f"{SCRIPT} {' '.join(SYNTHETIC)} trainer.steps=20 trainer.log_interval=10 "
                      f"output_dir={tmp_path / 'out'} trainer.checkpoint_dir={run / 'checkpoint'} "
                      "trainer.resume=true"),
        r.stderr.splitlines()[-1])
    assert m and os.path.samefile(m[1], sys.executable), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "in _after_step\n" in log.read_text()
    assert log.read_text().endswith("in failing\nRuntimeError: eval exploded\n")
    assert (run / "checkpoint" / "latest").read_text() == "20"  # saved before the evaluation


def test_recpipe_traceback_prints_the_traceback_instead_of_writing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from recpipe.train.cli import _unexpected as unexpected

    try:
        raise ValueError("bad\nsecond line")
    except ValueError as e:
        error = e
    monkeypatch.setenv("RECPIPE_TRACEBACK", "1")
    assert unexpected(error, str(tmp_path), None) == "error: ValueError: bad (the traceback is above)"
    assert 'raise ValueError("bad\\nsecond line")' in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    monkeypatch.delenv("RECPIPE_TRACEBACK")
    log = tmp_path / "out" / "error-rank0.log"
    assert unexpected(error, str(tmp_path / "out"), None) == (
        f"error: ValueError: bad (the traceback is in {log}; RECPIPE_TRACEBACK=1 prints it here)")
    assert 'raise ValueError("bad\\nsecond line")' in log.read_text()
    assert capsys.readouterr().err == ""


def test_a_config_error_loads_no_torch(tmp_path: Path) -> None:
    """The one line comes before torch (3 s to import here) and torchrec are loaded."""
    r = subprocess.run([sys.executable, "-X", "importtime", SCRIPT, "trainer.steps=0"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    imported = re.findall(r"^import time:.*\| +(\S+)$", r.stderr, re.M)
    assert r.returncode == 1 and "error: trainer.steps=0: must be > 0" in r.stderr.splitlines()
    assert "hydra" in imported  # the check can fail
    assert [m for m in imported if m.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu")] == []


@pytest.mark.parametrize("launcher", ["recpipe.train.torchrun", "torch.distributed.run"])
def test_torchrun_ends_with_our_error(tmp_path: Path, launcher: str) -> None:
    """recpipe-torchrun prints our line alone, with the rank's status; plain torchrun adds its
    report (exit 1), where our line is the root cause, not a link to its docs. No traceback
    goes through our code."""
    r = subprocess.run(
        [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2", SCRIPT, "trainer.steps=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},  # a newcomer's shell
    )
    output, line = r.stdout + r.stderr, "error: trainer.steps=0: must be > 0"
    assert r.returncode == 1, output
    if launcher == "recpipe.train.torchrun":
        # rank 0's, or rank 1's where it failed first and torchrun stopped rank 0 before its own
        assert output.splitlines() in ([line], [f"{line} (rank 1)"]), output
    else:
        assert f"  traceback : {line}" in output.splitlines() and "To enable traceback" not in output
    assert f'File "{ROOT / "scripts"}' not in output and f'File "{ROOT / "train"}' not in output


def _failure(tmp_path: Path, rank: int, exitcode: int, line: str | None, timestamp: int) -> ProcessFailure:
    """torchrun's record of a rank that ended with ``line`` in its error file (None: no file),
    having chosen exit status ``exitcode``; a line ending "!" is one every rank ended with by
    agreement."""
    path = tmp_path / f"error{rank}.json"
    if line is not None:
        info = {"timestamp": str(timestamp), "time": timestamp + 0.5, "status": exitcode,
                "together": line.endswith("!")}
        path.write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
        exitcode = -15  # torchrun killed it as it exited
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("case, status, printed", [
    ({0: (1, "error: bad"), 1: (1, "error: bad")}, 1, None),  # rank 0 printed it
    ({1: (143, "interrupted (SIGTERM) after step 3: ...!")}, 143,
     "interrupted (SIGTERM) after step 3: ...! (rank 1)"),
    ({0: (1, "error: OSError: gone (on rank 1)!", 5), 1: (1, "error: OSError: gone (rank1.log)!", 4)},
     1, None),  # stopped together: rank 0's line names the failing rank
    ({0: (1, "error: RuntimeError: Connection closed by peer"), 1: (-9, None)}, 137,
     "error: rank 1 was killed by SIGKILL"),  # the root cause, not what it caused
    ({2: (-11, None), 3: (-9, None)}, 139, "error: rank 2 was killed by SIGSEGV"),  # the earliest
    ({0: (-15, None), 1: (1, "error: bad")}, 1, "error: bad (rank 1)"),  # torchrun stopped rank 0
    ({0: (1, "error: RuntimeError: Connection closed by peer", 5), 1: (1, "error: data.path: bad line", 4)},
     1, "error: data.path: bad line (rank 1)"),  # the first line, not what it caused on rank 0
    ({1: (2, None)}, 2, "error: rank 1 exited with status 2 (its output is above)"),
])
def test_recpipe_torchrun_reports_the_root_failure(tmp_path: Path, case: dict, status: int, printed: str | None) -> None:
    failures = {r: _failure(tmp_path, r, code, line, timestamp=t[0] if t else r)  # t: when, else r
                for r, (code, line, *t) in case.items()}
    assert _root(failures) == (status, printed)


def _failing_then_resumed(rank: int, world: int, device: torch.device, tmp: str,
                          cases: list[tuple[str, int, Exception]]) -> list[tuple]:
    """Per case (where, failing rank, error): on that rank ``error`` is raised by the source as
    the pipeline reads batch 9 (two steps ahead of the model; ``where="data"``), or by the
    metrics log of step 10 (``"log"``); then the run is resumed. Returns per case what this rank
    raised (its type, its message or its cause's, its checkpoint), the resumed run's log steps,
    and whether its metrics.jsonl rows are those of a run that never failed (rank 0)."""
    from recpipe.train.data import SyntheticSource

    batches, record = SyntheticSource.train_batches, trainer._Trainer._record
    short = ("trainer.steps=12", "trainer.log_interval=5")
    reference = _rows(train(config(*short, "trainer.checkpoint=false"), device, f"{tmp}/ref"))
    out = []
    for i, (where, failing, error) in enumerate(cases):

        def failing_source(self, r, w, start, stop):
            for step, batch in zip(range(start, stop), batches(self, r, w, start, stop)):
                if step == 9 and r == failing:
                    raise error
                yield batch

        def failing_record(self, row, rows):
            record(self, row, rows)
            if row["step"] == 10 and self.rank == failing:
                raise error

        common = (*short, f"trainer.checkpoint_dir={tmp}/ck{i}")
        if where == "data":
            SyntheticSource.train_batches = failing_source
        else:
            trainer._Trainer._record = failing_record
        try:
            train(config(*common), device, f"{tmp}/a{i}")
        except (RunFailed, UsageError) as e:
            raised = (type(e).__name__, str(e.__cause__ if isinstance(e, RunFailed) else e), e.checkpoint)
        finally:
            SyntheticSource.train_batches, trainer._Trainer._record = batches, record
        rest = train(config(*common, "trainer.resume=true"), device, f"{tmp}/b{i}")
        written = Path(f"{tmp}/b{i}/metrics.jsonl").read_text().splitlines() if rank == 0 else []
        out.append((raised, [s for s, _, _ in losses(rest)], _rows([json.loads(x) for x in written]) == reference))
    return out


def test_the_data_source_failing_mid_run_saves_the_step_and_the_resume_logs_the_same_rows(
    gloo, tmp_path: Path
) -> None:
    """World size 1: the source raises (an unexpected error, or a bad file the user can fix);
    the pipeline ends the step it is in, which is saved and named, and the resumed run logs the
    rows of a run that never failed."""
    errors = [OSError("the disk went away"), UsageError("day_0.tsv line 9: 38 columns, Criteo's have 40")]
    results = _failing_then_resumed(0, 1, gloo, str(tmp_path), [("data", 0, e) for e in errors])
    for i, (kind, error) in enumerate(zip(("RunFailed", "UsageError"), errors)):
        saved = (str(tmp_path / f"ck{i}/step_8"), str(tmp_path / f"ck{i}"))  # batches 0-7 trained
        assert results[i] == ((kind, str(error), saved), [10, 12], True)


def test_a_failure_on_one_rank_stops_both_after_one_saved_step(tmp_path: Path) -> None:
    """World size 2: rank 1's source raises, or rank 0's metrics log: both ranks save the step
    and stop, the failing rank with its error, the other naming it; the resumed run logs the
    rows of a run that never failed."""
    error = OSError("the disk went away")
    cases = [("data", 1, error), ("log", 0, error)]
    results = run_ranks(2, _failing_then_resumed, str(tmp_path), cases)
    for i, ((where, failing, _), step) in enumerate(zip(cases, (8, 10))):
        saved = (str(tmp_path / f"ck{i}/step_{step}"), str(tmp_path / f"ck{i}"))
        assert results[failing][i][0] == ("RunFailed", "the disk went away", saved)
        other = ("PeerFailed", f"OSError: the disk went away (on rank {failing})", saved)
        assert results[1 - failing][i][0] == other
        assert results[0][i][1:] == ([10, 12] if where == "data" else [12], True)


def test_a_source_failing_while_the_pipeline_fills_raises_at_once(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1 (the second the pipeline reads before its first step): raised as it is, with
    nothing trained or saved (on several ranks, a rank with one batch would skip a collective)."""
    from recpipe.train.data import SyntheticSource

    batches = SyntheticSource.train_batches

    def failing_source(self, r, w, start, stop):
        yield next(batches(self, r, w, start, stop))
        raise OSError("the disk went away")

    monkeypatch.setattr(SyntheticSource, "train_batches", failing_source)
    with pytest.raises(RunFailed) as e:
        train(config("trainer.steps=12", f"trainer.checkpoint_dir={tmp_path / 'ck'}"), gloo, str(tmp_path / "a"))
    assert str(e.value.__cause__) == "the disk went away" and e.value.checkpoint is None
    assert not (tmp_path / "ck" / "latest").exists()
