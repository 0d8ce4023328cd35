"""Checkpoints: resume on 2 ranks with every optimizer and both pipelines, kill -9 while training
and while saving, evaluation leaves training alone, a diverged run saves nothing bad, what a
checkpoint directory keeps, and every directory resume or a fresh run refuses."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_utils import run_ranks
from test_train import SYNTHETIC, ROOT, config, gloo, losses, one_rank  # noqa: F401 (gloo: a fixture)

from recpipe.train.checkpoint import PAUSE_ENV, CheckpointDir, CheckpointError, identity
from recpipe.train.data import SyntheticSource
from recpipe.train.trainer import NonFiniteError, train
from recpipe.testing.synthetic import build_sharded
from recpipe.pipeline.topology import NodeLayout

SHORT = ("trainer.steps=20", "trainer.log_interval=5")


def _two_rank_runs(rank: int, world: int, device, tmp: str) -> dict:
    """Per (pipeline, optimizer): the losses of an uninterrupted run without evaluation, and of
    a run stopped at step 10 and resumed, evaluating every 5 steps. The adagrad run is saved by
    1 node x 2 ranks and resumed by 2 nodes x 1 (torchrun's LOCAL_WORLD_SIZE)."""
    out = {}
    for pipeline, optimizer in (("recpipe", "sgd"), ("torchrec", "sgd"), ("recpipe", "adagrad")):
        d = os.path.join(tmp, f"{pipeline}-{optimizer}")
        base = (*SHORT, f"pipeline={pipeline}", f"trainer.optimizer={optimizer}")
        if pipeline == "recpipe":  # torchrec's full run is recpipe's (test_train checks it)
            out[optimizer] = losses(train(config(*base, "trainer.eval=false"), device, f"{d}/full"))
        ck = f"trainer.checkpoint_dir={d}/ck"
        first = train(config(*base, ck, "trainer.stop_after=10", "trainer.eval_interval=5"), device, f"{d}/a")
        if optimizer == "adagrad":
            os.environ["LOCAL_WORLD_SIZE"] = "1"
        rest = train(config(*base, ck, "trainer.resume=true", "trainer.eval_interval=5"), device, f"{d}/b")
        out[pipeline, optimizer] = losses(first + rest), rest
    return out


def test_two_ranks_resume_bit_identical_with_every_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks' (see test_train.gloo)
    results = run_ranks(2, _two_rank_runs, str(tmp_path))[0]  # rank 0 logs the rows
    for pipeline, optimizer in (("recpipe", "sgd"), ("torchrec", "sgd"), ("recpipe", "adagrad")):
        resumed, rest = results[pipeline, optimizer]
        assert [s for s, _, _ in results[optimizer]] == [5, 10, 15, 20]
        assert resumed == results[optimizer], (pipeline, optimizer)  # and evaluating changed nothing
        assert [r["step"] for r in rest if "eval_auc" in r] == [15, 20]
    meta = json.loads((tmp_path / "recpipe-adagrad/ck/step_20/meta.json").read_text())
    assert (meta["world_size"], meta["local_world_size"], meta["step"]) == (2, 1, 20)
    saved = json.loads((tmp_path / "recpipe-adagrad/ck/step_10/meta.json").read_text())
    assert saved["local_world_size"] == 2  # by 1 node x 2, resumed by 2 nodes x 1


def _agree_failing(rank: int, world: int, device) -> str:
    from recpipe.train.checkpoint import CheckpointError, _agree

    try:
        _agree(lambda: Path(None))  # a TypeError on rank 0
    except (TypeError, CheckpointError) as e:
        return type(e).__name__
    return "returned"


def test_an_unexpected_error_on_rank_0_reaches_every_rank() -> None:
    """Rank 0 raises its own error; the other ranks stop with a CheckpointError naming it, not
    waiting for a broadcast that never comes."""
    assert run_ranks(2, _agree_failing) == ["TypeError", "CheckpointError"]


def test_evaluation_does_not_change_training_on_one_rank(gloo, tmp_path: Path) -> None:
    per = {}
    for pipeline in ("recpipe", "torchrec"):
        base = ("trainer.steps=12", "trainer.log_interval=1", f"pipeline={pipeline}", "trainer.checkpoint=false")
        without = train(config(*base, "trainer.eval=false"), gloo, str(tmp_path / f"{pipeline}-0"))
        with_eval = train(config(*base, "trainer.eval_interval=3"), gloo, str(tmp_path / f"{pipeline}-1"))
        assert [r["step"] for r in with_eval if "eval_auc" in r] == [3, 6, 9, 12]
        assert losses(with_eval) == losses(without)
        per[pipeline] = [{k: v for k, v in r.items() if k != "samples_per_s"} for r in with_eval]
    assert per["recpipe"] == per["torchrec"]  # evaluation too: same numbers on both pipelines


def test_diverged_run_stops_naming_the_step_and_saves_nothing_after(gloo, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    cfg = config(*SHORT, "trainer.lr=50", "trainer.log_interval=2", "trainer.checkpoint_interval=4",
                 f"trainer.checkpoint_dir={ck}")
    with pytest.raises(NonFiniteError, match=r"non-finite at step \d+ \(trainer.lr=50\)") as e:
        train(cfg, gloo, str(tmp_path))
    bad = int(re.search(r"step (\d+)", str(e.value)).group(1))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] != rows[-1]["loss"] or abs(rows[-1]["loss"]) == float("inf")
    assert rows[-1]["step"] - 2 < bad <= rows[-1]["step"]
    latest = int((ck / "latest").read_text())
    assert latest < bad and sorted(os.listdir(ck)) == [".lock", "latest", f"step_{latest}"]


def _sums_ok(step_dir: Path) -> bool:
    listed = dict(reversed(line.split("  ", 1)) for line in (step_dir / "sha256sums").read_text().splitlines())
    files = {p.name for p in step_dir.iterdir()} - {"sha256sums"}
    return files == set(listed) and all(
        hashlib.sha256((step_dir / n).read_bytes()).hexdigest() == h for n, h in listed.items())


def test_keeps_the_newest_checkpoints_and_overwrite_starts_over(gloo, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    base = (*SHORT, "trainer.eval=false", f"trainer.checkpoint_dir={ck}")
    train(config(*base, "trainer.checkpoint_interval=5", "trainer.keep_checkpoints=2"), gloo, str(tmp_path))
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_15", "step_20"]
    assert (ck / "latest").read_text() == "20" and _sums_ok(ck / "step_20") and _sums_ok(ck / "step_15")
    train(config(*base, "trainer.steps=5", "trainer.overwrite=true"), gloo, str(tmp_path))
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_5"] and (ck / "latest").read_text() == "5"


# kill -9: a subprocess of scripts/train.py, killed, then resumed; the reference runs in-process

KILL_RUN = ("trainer.steps=120", "trainer.log_interval=10", "trainer.checkpoint_interval=20",
            "trainer.keep_checkpoints=0", "trainer.eval=false")


def _start(tmp: Path, *overrides: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/train.py"), *SYNTHETIC, *overrides,
         f"output_dir={tmp / 'out'}"],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def _wait_until(done: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < end, f"no {what}"
        time.sleep(0.02)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    _wait_until(path.exists, proc, str(path))


def _latest(ck: Path) -> int:
    """The step `latest` names, or -1 before the first one (it is replaced atomically)."""
    try:
        return int((ck / "latest").read_text())
    except FileNotFoundError:
        return -1


def _history(ck: Path) -> list[tuple]:
    """The training rows of the latest checkpoint's history."""
    step = (ck / "latest").read_text()
    return losses([json.loads(x) for x in (ck / f"step_{step}" / "metrics.jsonl").read_text().splitlines()])


def test_kill_9_while_training_and_while_saving_then_resume(gloo, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run = (*KILL_RUN, f"trainer.checkpoint_dir={ck}")
    p = _start(tmp_path, *run)
    _wait_until(lambda: _latest(ck) >= 40, p, "latest >= 40")  # training on after a checkpoint or two
    p.kill()
    p.wait()
    latest = _latest(ck)
    assert _sums_ok(ck / f"step_{latest}")
    pause = min(latest + 40, 120)  # the resumed run's second save (or its last)
    p = _start(tmp_path, *run, "trainer.resume=true", **{PAUSE_ENV: str(pause)})
    _wait_for(ck / f"step_{pause}" / ".metadata", p)  # DCP wrote it; sha256sums and latest not yet
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (ck / "latest").read_text() == str(pause - 20)
    assert not (ck / f"step_{pause}" / "sha256sums").exists()
    p = _start(tmp_path, *run, "trainer.resume=true")
    assert p.wait(timeout=300) == 0, p.communicate()[0]
    assert all(_sums_ok(d) for d in ck.glob("step_*"))  # the unfinished save was redone
    assert (ck / "latest").read_text() == "120"
    reference = train(config(*KILL_RUN, "trainer.checkpoint=false"), gloo, str(tmp_path / "ref"))
    assert _history(ck) == losses(reference)


# refused: the message names the problem and the fix; `latest` stays as it was

RUN = ("trainer.steps=20", "trainer.log_interval=10", "trainer.eval=false")
RESUME = ("trainer.resume=true",)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory at step 20 (in-process, once)."""
    ck = tmp_path_factory.mktemp("made") / "ck"
    with one_rank() as device:
        train(config(*RUN, f"trainer.checkpoint_dir={ck}"), device, str(ck.parent / "run"))
    return ck


def _corrupt(ck: Path) -> None:
    path = ck / "step_20" / "__0_0.distcp"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\x5a" * 4096)


def _lock(ck: Path) -> Callable[[], None]:
    """Hold the directory's lock as a live run would."""
    fd = os.open(ck / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, b"pid 4242 on elsewhere\n")
    return lambda: os.close(fd)


REFUSED = {
    "fresh run into a used dir": (None, (), "already holds checkpoints (step_20): continue them "
                                  "with trainer.resume=true, start over with trainer.overwrite=true"),
    "another config": (None, (*RESUME, "model.dim=8"),
                       "step_20 is of another configuration (model.dim=16 there, 8 here)"),
    "steps below the checkpoint": (None, (*RESUME, "trainer.steps=10"),
                                   "trainer.steps=10 but {ck}/step_20 is at step 20: pass trainer.steps above 20"),
    "latest missing": (lambda ck: (ck / "latest").unlink(), RESUME, "{ck} has no 'latest' file"),
    "latest empty": (lambda ck: (ck / "latest").write_text(""), RESUME,
                     "{ck}/latest is empty: write the step of a complete checkpoint (step_20) into"),
    "latest garbage": (lambda ck: (ck / "latest").write_text("2O\n"), RESUME,
                       "{ck}/latest holds '2O', not a step number"),
    "metadata missing": (lambda ck: (ck / "step_20" / ".metadata").unlink(), RESUME,
                         "{ck}/step_20 is incomplete (no DCP's .metadata): start over: drop "
                         "trainer.resume, add trainer.overwrite=true"),
    "corrupt": (_corrupt, RESUME, "{ck}/step_20 is corrupt (__0_0.distcp does not match sha256sums)"),
    "no such dir": (shutil.rmtree, RESUME, "no checkpoint directory {ck}: check trainer.checkpoint_dir"),
    "in use": (_lock, RESUME, "{ck} is in use by another run (pid 4242 on elsewhere): wait for it"),
}


def refusal(made: Path, tmp: Path, case: str) -> tuple[Path, tuple[str, ...], str, Callable[[], None]]:
    """A copy of ``made`` changed as ``case`` says: (its path, the run's overrides, the message
    expected, what releases a lock taken)."""
    change, overrides, message = REFUSED[case]
    ck = tmp / "ck"
    shutil.copytree(made, ck)
    release = change(ck) if change else None
    return ck, overrides, message.format(ck=ck), release if callable(release) else lambda: None


def latest_state(ck: Path) -> tuple[bytes, int] | None:
    latest = ck / "latest"
    return (latest.read_bytes(), latest.stat().st_mtime_ns) if latest.exists() else None


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_naming_the_problem_and_the_fix(gloo, made: Path, tmp_path: Path, case: str) -> None:
    ck, overrides, message, release = refusal(made, tmp_path, case)
    before = latest_state(ck)
    try:
        with pytest.raises(CheckpointError) as e:
            train(config(*RUN, *overrides, f"trainer.checkpoint_dir={ck}"), gloo, str(tmp_path / "out"))
    finally:
        release()
    assert message in str(e.value) and "\n" not in str(e.value)
    assert latest_state(ck) == before and not (tmp_path / "out").exists()


def test_keys_the_data_source_does_not_read_do_not_block_a_resume(gloo, made: Path, tmp_path: Path) -> None:
    """MovieLens reads no ``model.num_tables``, the synthetic data no ``data.max_history``:
    changing them resumes; a key the source reads is still compared."""
    movielens = ("data=movielens", "model=movielens")
    assert identity(config(*movielens, "model.num_tables=9")) == identity(config(*movielens))
    assert identity(config(*movielens, "data.max_history=5")) != identity(config(*movielens))
    ck = tmp_path / "ck"
    shutil.copytree(made, ck)
    unused = ("data.max_history=5", "data.label_scope=train", "data.eval_fraction=0.5")
    train(config(*RUN, *RESUME, *unused, "trainer.steps=22", f"trainer.checkpoint_dir={ck}"),
          gloo, str(tmp_path / "out"))
    assert (ck / "latest").read_text() == "22"


def test_a_checkpoint_that_does_not_fit_is_refused_at_load(gloo, made: Path, tmp_path: Path) -> None:
    """Shapes that only the data decide (a real data set's row counts) or a world size DCP cannot
    reshard to: DCP's error, on one line, with what to do."""
    ck = tmp_path / "ck"
    shutil.copytree(made, ck)
    spec = SyntheticSource.from_config(config(*RUN, "model.dim=8")).spec
    model, optimizer = build_sharded(spec, ["table_wise"], gloo, dist.group.WORLD)
    resume = config(*RUN, *RESUME, "trainer.steps=30", f"trainer.checkpoint_dir={ck}")
    with CheckpointDir.open(str(ck), resume) as d:
        with pytest.raises(CheckpointError, match=r"step_20 does not fit this model \(Size mismatch"):
            d.load(model, optimizer)
        d.resume = dataclasses.replace(d.resume, layout=NodeLayout(2, 1))
        with pytest.raises(CheckpointError, match=r"\(world size 2: 2 nodes x 1 rank\(s\)\) cannot be "
                                                  r"resharded to world size 1 \(Size mismatch.*\): "
                                                  r"resume with 2 ranks$"):
            d.load(model, optimizer)
