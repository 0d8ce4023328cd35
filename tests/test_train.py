"""The Hydra training job: trains on CPU, both pipelines agree, bad configs fail clearly, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recpipe.pipeline.app.config import register, validate
from recpipe.pipeline.app.trainer import train

ROOT = Path(__file__).resolve().parents[1]
register()


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))
    validate(cfg)
    return cfg


@pytest.fixture
def gloo(monkeypatch: pytest.MonkeyPatch):
    """A one-rank gloo group in this process."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield torch.device("cpu")
    dist.destroy_process_group()


def test_trains_in_process_and_loss_falls(gloo, tmp_path: Path) -> None:
    cfg = config("trainer.steps=60", "trainer.log_interval=20", f"output_dir={tmp_path}")
    metrics = train(cfg, gloo, str(tmp_path))
    assert [m["step"] for m in metrics] == [20, 40, 60]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [20, 40, 60]
    assert (tmp_path / "checkpoint" / "latest").read_text() == "60"


def test_resume_reaches_the_same_losses(gloo, tmp_path: Path) -> None:
    common = ["trainer.steps=40", "trainer.log_interval=10", "pipeline=recpipe"]
    full = train(config(*common, f"trainer.checkpoint_dir={tmp_path / 'a'}"), gloo, str(tmp_path / "a"))
    ck = tmp_path / "b"
    first = train(config(*common, "trainer.stop_after=20", f"trainer.checkpoint_dir={ck}"), gloo, str(ck))
    assert [m["step"] for m in first] == [10, 20]
    rest = train(config(*common, "trainer.resume=true", f"trainer.checkpoint_dir={ck}"), gloo, str(ck))
    assert [m["step"] for m in rest] == [30, 40]
    assert [m["loss"] for m in first + rest] == [m["loss"] for m in full]


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.stepz=3", "Key 'stepz' not in 'TrainerConfig'"),
        ("trainer.steps=0", "trainer.steps=0: must be > 0"),
        ("trainer.optimizer=adam", "trainer.optimizer='adam': expected one of sgd, adagrad"),
        ("sharding.types=[diagonal]", "sharding.types='diagonal'"),
        ("trainer.lr=fast", "trainer.lr"),
        ("pipeline.dense_allreduce=symm_mem", "pipeline.dense_allreduce=symm_mem needs hardware=cuda"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path, override: str, message: str) -> None:
    r = _run([str(ROOT / "scripts/train.py"), override, f"output_dir={tmp_path}"], tmp_path)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr
    assert not any(tmp_path.iterdir())  # failed before making a run directory


def test_torchrun_two_ranks_both_pipelines_agree(tmp_path: Path) -> None:
    losses = {}
    for pipeline in ("torchrec", "recpipe"):
        out = tmp_path / pipeline
        r = _run(
            ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
             str(ROOT / "scripts/train.py"), f"pipeline={pipeline}", "trainer.steps=30",
             "trainer.deterministic=true",  # as the GPU check runs it
             "trainer.log_interval=10", f"output_dir={out}"],
            tmp_path,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        (run,) = list(out.iterdir())  # rank 0 alone made the run directory
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[pipeline] = [(m["step"], m["loss"], m["last_loss"]) for m in rows]
    assert [s for s, _, _ in losses["recpipe"]] == [10, 20, 30]
    assert losses["recpipe"] == losses["torchrec"]
    assert losses["recpipe"][-1][1] < losses["recpipe"][0][1]
