"""Structured (dataclass) configs of the training job; Hydra's schema for configs/.

Unknown keys and wrongly typed values fail when Hydra composes the config (OmegaConf names the
key); :func:`validate` checks values (``steps > 0``...) with messages naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


@dataclass
class ModelConfig:
    num_tables: int = 4  # per sparse module
    rows: int = 1000
    dim: int = 16
    weighted: bool = True  # a weighted EmbeddingBagCollection too
    sequence: bool = True  # an EmbeddingCollection too


@dataclass
class DataConfig:
    schema: str = "synthetic"  # synthetic | criteo (13 dense + 26 sparse features) | movielens | criteo_tsv
    batch_size: int = 64  # per rank
    pooling: int = 4  # mean ids per sample and feature
    zipf: float = 1.1
    dense_in: int = 13
    seed: int = 0
    path: str | None = None  # movielens: the converted .npz; criteo_tsv: a file or directory
    eval_fraction: float = 0.2  # movielens: the last (time-ordered) fraction is the eval part
    max_history: int = 20  # movielens: cap on the user's earlier items per sample


@dataclass
class ShardingConfig:
    types: list[str] = field(default_factory=lambda: ["table_wise", "column_wise"])


@dataclass
class PipelineConfig:
    name: str = "recpipe"  # recpipe | torchrec
    # dense-gradient all-reduce: ddp (torchrec's default) | nccl (recpipe's bucketed all-reduce,
    # compiled, through functional collectives: NCCL, gloo on CPU) | symm_mem (the same through
    # symmetric memory; CUDA, one host) | auto (symm_mem on CUDA, else nccl)
    dense_allreduce: str = "ddp"


@dataclass
class HardwareConfig:
    device: str = "cpu"  # cpu | cuda
    backend: str = "gloo"  # gloo | nccl


@dataclass
class TrainerConfig:
    steps: int = 300
    lr: float = 0.05
    optimizer: str = "sgd"  # sgd | adagrad
    log_interval: int = 25
    seed: int = 1
    checkpoint_dir: str | None = None  # default: <run dir>/checkpoint
    checkpoint_interval: int = 0  # steps; 0: only at the end
    checkpoint: bool = True  # false: write no checkpoint at all (benchmark runs)
    resume: bool = False  # continue from checkpoint_dir's latest checkpoint
    stop_after: int | None = None  # stop (as if interrupted) after this many steps
    deterministic: bool = False  # deterministic GPU kernels: repeatable losses, slower


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    sharding: ShardingConfig = MISSING
    pipeline: PipelineConfig = MISSING
    hardware: HardwareConfig = MISSING
    trainer: TrainerConfig = MISSING
    output_dir: str = "outputs"


def register() -> None:
    """Register the schemas with Hydra (``configs/*/*.yaml`` extend them)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in (
        ("model", ModelConfig), ("data", DataConfig), ("sharding", ShardingConfig),
        ("pipeline", PipelineConfig), ("hardware", HardwareConfig), ("trainer", TrainerConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(allowed)}")


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{key}={value}: must be {'>= 0' if zero_ok else '> 0'}")


def validate(cfg: TrainConfig) -> None:
    """Raise ValueError naming the first bad key."""
    _choice("data.schema", cfg.data.schema, ("synthetic", "criteo"))
    _choice("pipeline.name", cfg.pipeline.name, ("recpipe", "torchrec"))
    _choice("pipeline.dense_allreduce", cfg.pipeline.dense_allreduce,
            ("ddp", "nccl", "symm_mem", "auto"))
    _choice("hardware.device", cfg.hardware.device, ("cpu", "cuda"))
    _choice("hardware.backend", cfg.hardware.backend, ("gloo", "nccl"))
    _choice("trainer.optimizer", cfg.trainer.optimizer, ("sgd", "adagrad"))
    for t in cfg.sharding.types:
        _choice("sharding.types", t, SHARDING_TYPES)
    if not cfg.sharding.types:
        raise ValueError("sharding.types: give at least one sharding type")
    for key in ("model.num_tables", "model.rows", "model.dim", "data.batch_size",
                "data.dense_in", "trainer.steps", "trainer.log_interval"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name))
    _positive("data.pooling", cfg.data.pooling, zero_ok=True)
    _positive("trainer.lr", cfg.trainer.lr)
    _positive("trainer.checkpoint_interval", cfg.trainer.checkpoint_interval, zero_ok=True)
    if cfg.model.dim % 4:
        raise ValueError(f"model.dim={cfg.model.dim}: must be a multiple of 4 (fbgemm TBE)")
    if cfg.pipeline.dense_allreduce == "symm_mem" and cfg.hardware.device != "cuda":
        raise ValueError("pipeline.dense_allreduce=symm_mem needs hardware=cuda")
    if cfg.hardware.device == "cuda" and cfg.hardware.backend != "nccl":
        raise ValueError("hardware.backend must be nccl with hardware.device=cuda")
