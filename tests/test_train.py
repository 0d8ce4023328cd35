"""The Hydra training job: trains on CPU, both pipelines agree, bad configs fail clearly, resume."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from dist_utils import one_rank
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recpipe.train.config import UsageError, register, validate
from recpipe.train.trainer import _Progress, train

ROOT = Path(__file__).resolve().parents[1]
register()


#: the tests' data and model: the fast synthetic ones (the job's default is MovieLens-100k)
SYNTHETIC = ("data=synthetic", "model=tiny")


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = OmegaConf.to_object(
            compose(config_name="train", overrides=[*SYNTHETIC, *overrides]))
    validate(cfg)
    return cfg


@pytest.fixture
def gloo() -> Iterator[torch.device]:
    with one_rank() as device:
        yield device


def losses(rows: list[dict]) -> list[tuple]:
    """The training rows' (step, loss, last_loss); evaluation rows left out."""
    return [(r["step"], r["loss"], r["last_loss"]) for r in rows if "loss" in r]


def test_trains_in_process_and_loss_falls(gloo, tmp_path: Path) -> None:
    cfg = config("trainer.steps=60", "trainer.log_interval=20", f"output_dir={tmp_path}")
    metrics = train(cfg, gloo, str(tmp_path))
    assert [s for s, _, _ in losses(metrics)] == [20, 40, 60]
    assert metrics[-2]["loss"] < metrics[0]["loss"]
    assert set(metrics[-1]) == {"step", "eval_auc", "eval_logloss"} and metrics[-1]["step"] == 60
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == metrics
    assert (tmp_path / "checkpoint" / "latest").read_text() == "60"


def _rows(rows: Iterable[dict]) -> list[dict]:
    """Metrics rows without their timing (``samples_per_s``)."""
    return [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows]


def test_resume_off_a_log_step_logs_the_rows_of_an_uninterrupted_run(
    gloo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped at step 25 (rows every 10 steps) and resumed: the same rows, bit for bit (the
    checkpoint keeps steps 21-25 for the row at 30), and ``done:`` starts at the run's first."""
    caplog.set_level(logging.INFO, logger="recpipe")
    common = ["trainer.steps=40", "trainer.log_interval=10", "pipeline=recpipe"]
    full = train(config(*common, f"trainer.checkpoint_dir={tmp_path / 'a'}"), gloo, str(tmp_path / "a"))
    ck = tmp_path / "b"
    first = train(config(*common, "trainer.stop_after=25", f"trainer.checkpoint_dir={ck}"), gloo, str(ck))
    assert [m["step"] for m in first] == [10, 20]  # none at 25, as in the uninterrupted run
    caplog.clear()
    rest = train(config(*common, "trainer.resume=true", f"trainer.checkpoint_dir={ck}"), gloo, str(ck))
    assert [s for s, _, _ in losses(rest)] == [30, 40]
    assert _rows(first + rest) == _rows(full)
    history = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
    assert history == first + rest  # the resumed run's file continues the first one's rows
    (done,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert done.startswith(f"done: loss {full[0]['loss']:.4f} -> {losses(full)[-1][1]:.4f}, ")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Off a terminal (a log file, CI, SLURM): a line at the first metrics row, then one per
    PROGRESS_SECONDS at most; on a terminal: tqdm's bar and no lines."""
    caplog.set_level(logging.INFO, logger="recpipe")
    row = {"step": 10, "loss": 0.5, "auc": 0.75, "samples_per_s": 640.0, "last_loss": 0.5}
    progress = _Progress(0, 100, 0, "recpipe")
    progress.row(row, steps_per_s=10.0)
    progress.row({**row, "step": 20}, steps_per_s=10.0)  # within PROGRESS_SECONDS: no line
    progress.close()
    assert caplog.messages == ["step 10/100: loss 0.5000, auc 0.750, 640 samples/s, eta 0:00:09"]
    assert _Progress(1, 100, 0, "recpipe").lines is False  # other ranks: nothing
    caplog.clear()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    progress = _Progress(0, 100, 0, "recpipe")
    progress.step()
    progress.row(row, steps_per_s=10.0)
    progress.close()
    assert caplog.messages == [] and "1/100" in sys.stderr.getvalue()


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **env},
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.stepz=3", "error: Could not override 'trainer.stepz': Key 'stepz' not in 'TrainerConfig'"),
        ("trainer.lr=fast", "error: Error merging override trainer.lr=fast: Value 'fast' of type 'str'"),
        ("trainer.steps=0", "error: trainer.steps=0: must be > 0"),
        ("trainer.optimizer=adam", "error: trainer.optimizer='adam': expected one of sgd, adagrad"),
        ("sharding.types=[diagonal]", "error: sharding.types='diagonal'"),
        ("pipeline.dense_allreduce=symm_mem", "error: pipeline.dense_allreduce=symm_mem needs hardware=cuda"),
        ("trainer.lr=inf", "error: trainer.lr=inf: must be finite, > 0 and <= 100"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path, override: str, message: str) -> None:
    r = _run([str(ROOT / "scripts/train.py"), *SYNTHETIC, override, f"output_dir={tmp_path}"], tmp_path)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr
    if message.startswith("error: "):  # ours: one line, no traceback
        assert (r.stdout + r.stderr).splitlines() == [r.stderr.strip()]
    assert not any(tmp_path.iterdir())  # failed before making a run directory


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lr=1e6", "trainer.lr=1000000.0: must be finite, > 0 and <= 100"),
        ("trainer.lr=nan", "trainer.lr=nan: must be finite"),
        ("data.zipf=nan", "data.zipf=nan: must be finite, > 0"),
        ("data.zipf=0", "data.zipf=0.0: must be finite, > 0"),
        ("trainer.stop_after=-3", "trainer.stop_after=-3: must be > 0"),
        ("sharding=row_wise", "sharding.types=row_wise: torchrec has no CPU kernel for row-wise "
                              "sharding; use hardware=cuda"),
        ("sharding.types=[table_wise,table_row_wise]", "sharding.types=table_row_wise: torchrec has no CPU"),
        ("sharding.types=[data_parallel]", "sharding.types=data_parallel: torchrec 1.8's sharded "
                                           "EmbeddingCollection fails on data-parallel tables"),
        pytest.param("hardware=cuda", "hardware=cuda: 1 rank(s) on this host but 0 CUDA GPU(s) visible",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
        ("trainer.resume=true", "trainer.resume=true needs trainer.checkpoint_dir=DIR"),
        ("data.schema=criteo_tsv", "data.schema=criteo_tsv needs data.path="),
    ],
)
def test_values_and_options_this_machine_cannot_run_are_refused(override: str, message: str) -> None:
    """Before torchrec is called (scripts/train.py prints these as the ``error:`` lines above)."""
    with pytest.raises(UsageError, match=re.escape(message)):
        config(override)


def test_nodes_of_unequal_size_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nproc-per-node=2 here, 1 elsewhere
    with pytest.raises(UsageError, match="3 ranks do not split into nodes of LOCAL_WORLD_SIZE=2: "
                                         "launch the same --nproc-per-node on every node"):
        config()
