"""Structured (dataclass) configs of the training job; Hydra's schema for configs/.

Unknown keys and wrongly typed values fail when Hydra composes the config (OmegaConf names the
key); :func:`validate` checks values (``steps > 0``...) and what this machine can run (CUDA,
row-wise sharding) before torchrec is called, raising :class:`UsageError` with one line that
names the key and what to do. This module imports neither torch nor torchrec, and a bad value
fails before :func:`validate` imports them: a config error takes about 1 s, torch alone 3.
"""

from __future__ import annotations

import math
import os
from itertools import takewhile
from dataclasses import dataclass, field, fields

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
SCHEMAS = ("synthetic", "criteo", "movielens", "criteo_tsv")
MAX_LR = 100.0  # above this every optimizer offered diverges on every model here


class UsageError(Exception):
    """Something the user can fix (a config value, a checkpoint directory, a data file): the
    message is one line saying what is wrong and what to do. ``scripts/train.py`` prints it
    without a traceback and exits non-zero, naming ``checkpoint`` (step directory, checkpoint
    directory) to resume from where the trainer set it (a data file failing mid-run)."""

    checkpoint: tuple[str, str] | None = None
    #: every rank raised it at the same step, by agreement (the trainer's per-step decision)
    together: bool = False


@dataclass
class ModelConfig:
    num_tables: int = 4  # per sparse module
    rows: int = 1000
    dim: int = 16
    weighted: bool = True  # a weighted EmbeddingBagCollection too
    sequence: bool = True  # an EmbeddingCollection too
    over_arch: list[int] = field(default_factory=lambda: [64])  # hidden widths of the over-arch MLP


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
    # movielens: whose labels the user/item positive-rate features see: "earlier" (every event
    # strictly earlier in time, as a live system knows them) | "train" (the training part's)
    label_scope: str = "earlier"


@dataclass
class ShardingConfig:
    types: list[str] = field(default_factory=lambda: ["table_wise", "column_wise"])


@dataclass
class PipelineConfig:
    name: str = "recpipe"  # recpipe | torchrec
    # dense-gradient all-reduce: ddp (torchrec's default) | nccl (recpipe's bucketed all-reduce,
    # compiled, through functional collectives: NCCL, gloo on CPU) | symm_mem (the same through
    # symmetric memory; CUDA, inside one node) | auto (per bucket, the fastest of NCCL and the
    # symmetric algorithms in the machine's measured table, recpipe.ops.all_reduce_table; NCCL
    # where nothing was measured)
    dense_allreduce: str = "ddp"


@dataclass
class HardwareConfig:
    device: str = "cpu"  # cpu | cuda
    backend: str = "gloo"  # gloo | nccl
    # the planner's link bandwidths, GB/s per GPU and direction (recpipe.pipeline.topology):
    # inside a node (H200 NVLink) and across nodes (a 400 Gb/s NIC per GPU)
    intra_node_gb_s: float = 450.0  # = recpipe.pipeline.topology.INTRA_NODE_GB_S (tested)
    inter_node_gb_s: float = 50.0  # = recpipe.pipeline.topology.INTER_NODE_GB_S (tested)


@dataclass
class TrainerConfig:
    steps: int = 300
    lr: float = 0.05
    optimizer: str = "sgd"  # sgd | adagrad
    log_interval: int = 25
    seed: int = 1
    checkpoint_dir: str | None = None  # default: <run dir>/checkpoint
    # a checkpoint every checkpoint_interval steps or checkpoint_minutes of wall time, whichever
    # comes first (0: not by that measure), at the end and on SIGINT/SIGTERM
    checkpoint_interval: int = 1000
    checkpoint_minutes: float = 10.0
    keep_checkpoints: int = 3  # the newest N complete checkpoints stay; 0: all
    checkpoint: bool = True  # false: write no checkpoint at all (benchmark runs)
    resume: bool = False  # continue from checkpoint_dir's latest checkpoint
    overwrite: bool = False  # a fresh run may delete the checkpoints already in checkpoint_dir
    stop_after: int | None = None  # stop (as if interrupted) after this step
    eval: bool = True  # evaluate on the data source's held-out batches
    eval_interval: int = 0  # steps between evaluations; 0: at the end only
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


def save_yaml(cfg: TrainConfig, path: str) -> None:
    """Write ``cfg`` as YAML (the run's ``config.yaml``)."""
    OmegaConf.save(OmegaConf.structured(cfg), path)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"{key}={value!r}: expected one of {', '.join(allowed)}")


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if not value >= 0 or (value == 0 and not zero_ok):  # NaN fails too
        raise UsageError(f"{key}={value}: must be {'>= 0' if zero_ok else '> 0'}")


def _finite(key: str, value: float, high: float = math.inf) -> None:
    """``0 < value <= high`` and finite."""
    if not (math.isfinite(value) and 0 < value <= high):
        bound = f" and <= {high:g}" if math.isfinite(high) else ""
        raise UsageError(f"{key}={value}: must be finite, > 0{bound}")


def validate(cfg: TrainConfig) -> None:
    """Raise :class:`UsageError` naming the first bad key, or an option this machine cannot run."""
    _choice("data.schema", cfg.data.schema, SCHEMAS)
    _choice("data.label_scope", cfg.data.label_scope, ("earlier", "train"))
    _choice("pipeline.name", cfg.pipeline.name, ("recpipe", "torchrec"))
    _choice("pipeline.dense_allreduce", cfg.pipeline.dense_allreduce,
            ("ddp", "nccl", "symm_mem", "auto"))
    _choice("hardware.device", cfg.hardware.device, ("cpu", "cuda"))
    _choice("hardware.backend", cfg.hardware.backend, ("gloo", "nccl"))
    _choice("trainer.optimizer", cfg.trainer.optimizer, ("sgd", "adagrad"))
    for t in cfg.sharding.types:
        _choice("sharding.types", t, SHARDING_TYPES)
    if not cfg.sharding.types:
        raise UsageError("sharding.types: give at least one sharding type")
    for key in ("model.num_tables", "model.rows", "model.dim", "data.batch_size",
                "data.dense_in", "trainer.steps", "trainer.log_interval"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name))
    for key in ("data.pooling", "data.max_history", "trainer.checkpoint_interval",
                "trainer.keep_checkpoints", "trainer.eval_interval"):
        group, name = key.split(".")
        _positive(key, getattr(getattr(cfg, group), name), zero_ok=True)
    for width in cfg.model.over_arch:
        _positive("model.over_arch", width)
    for key in ("hardware.intra_node_gb_s", "hardware.inter_node_gb_s"):
        _finite(key, getattr(cfg.hardware, key.split(".")[1]))
    _finite("trainer.lr", cfg.trainer.lr, MAX_LR)
    _finite("data.zipf", cfg.data.zipf)
    if not (0 < cfg.data.eval_fraction < 1):
        raise UsageError(f"data.eval_fraction={cfg.data.eval_fraction}: must be in (0, 1)")
    if not (math.isfinite(cfg.trainer.checkpoint_minutes) and cfg.trainer.checkpoint_minutes >= 0):
        raise UsageError(f"trainer.checkpoint_minutes={cfg.trainer.checkpoint_minutes}: "
                         "must be finite and >= 0 (0: no time-based checkpoints)")
    if cfg.trainer.stop_after is not None:
        _positive("trainer.stop_after", cfg.trainer.stop_after)
    if cfg.model.dim % 4:
        raise UsageError(f"model.dim={cfg.model.dim}: must be a multiple of 4 (fbgemm TBE)")
    if cfg.data.schema == "criteo_tsv" and not cfg.data.path:
        raise UsageError("data.schema=criteo_tsv needs data.path=FILE_OR_DIRECTORY (Criteo TSV)")
    _validate_resume(cfg.trainer)
    _validate_hardware(cfg)


def _validate_resume(t: TrainerConfig) -> None:
    if t.resume and not t.checkpoint_dir:
        raise UsageError("trainer.resume=true needs trainer.checkpoint_dir=DIR: the checkpoint "
                         "directory of the run to continue")
    if t.resume and t.overwrite:
        raise UsageError("trainer.resume=true and trainer.overwrite=true contradict each other: "
                         "resume continues the checkpoints, overwrite deletes them; pick one")


def _validate_hardware(cfg: TrainConfig) -> None:
    """Options this machine (or torchrec 1.8) cannot run, before torchrec is called. Imports
    torch for ``hardware=cuda`` only, and checks the node layout last: its module loads
    torchrec (3 s), which only a config valid so far waits for."""
    if cfg.pipeline.dense_allreduce == "symm_mem" and cfg.hardware.device != "cuda":
        raise UsageError("pipeline.dense_allreduce=symm_mem needs hardware=cuda")
    if cfg.hardware.device == "cuda" and cfg.hardware.backend != "nccl":
        raise UsageError("hardware.backend must be nccl with hardware.device=cuda")
    if cfg.hardware.device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if gpus < local:
            raise UsageError(f"hardware=cuda: {local} rank(s) on this host but {gpus} CUDA GPU(s) "
                             "visible: use hardware=cpu, or one rank per GPU")
    row_wise = sorted({t for t in cfg.sharding.types if "row_wise" in t})
    if row_wise and cfg.hardware.device == "cpu":
        raise UsageError(f"sharding.types={row_wise[0]}: torchrec has no CPU kernel for row-wise "
                         "sharding; use hardware=cuda, or table_wise / column_wise on CPU")
    types = cfg.sharding.types
    has_ec = cfg.data.schema == "synthetic" and cfg.model.sequence
    if has_ec and any(types[i % len(types)] == "data_parallel" for i in range(cfg.model.num_tables)):
        raise UsageError("sharding.types=data_parallel: torchrec 1.8's sharded EmbeddingCollection "
                         "fails on data-parallel tables (model.sequence=true); set "
                         "model.sequence=false or give the tables another sharding type")
    from recpipe.pipeline.topology import LayoutError, node_layout

    try:  # torchrun's environment: nodes of equal size
        node_layout(int(os.environ.get("WORLD_SIZE", "1")))
    except LayoutError as e:
        raise UsageError(str(e)) from None


def composition_error(config_dir: str, config_name: str, overrides: list[str]) -> str | None:
    """One line for overrides Hydra cannot compose into ``config_name`` (a key typo, a value of
    the wrong type, an option a group lacks), naming the override and the fix; None if they
    compose. Hydra's own report of these takes 6 to 20 lines."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir, version_base=None):
            cfg = compose(config_name, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        if "Could not find" in lines[0]:  # an unknown group option: Hydra lists the group's
            listed = next((i for i, x in enumerate(lines) if x.startswith("Available")), len(lines))
            names = takewhile(lambda x: x.startswith("\t"), lines[listed + 1:])
            names = [x.strip() for x in names if not x.endswith("_schema")]
            return f"{lines[0]}: pick one of {', '.join(names)}"
        cause = e.__cause__ and str(e.__cause__).splitlines()[0]
        if cause:  # a key typo, a wrong type: OmegaConf's reason
            return f"{lines[0].rstrip('.')}: {cause} (the keys and types: recpipe.train.config)"
        return " ".join(x.strip() for x in lines[:2])  # the override grammar
    known = {f.name for f in fields(TrainConfig)} | {"hydra"}
    extra = sorted(set(cfg) - known)  # the root is not a struct: +key=value would be ignored
    if extra:
        return (f"no top-level config key {', '.join(map(repr, extra))}: the keys are "
                f"{', '.join(sorted(known - {'hydra'}))}")
    return None
