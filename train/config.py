"""Structured (dataclass) configs of the training job; Hydra's schema for configs/.

Unknown keys and wrongly typed values fail when Hydra composes the config (OmegaConf names the
key; :func:`unknown_key` finds those ``+key=value`` adds, which Hydra lets through);
:func:`validate` checks values (``steps > 0``...) and what this machine can run (CUDA, row-wise
sharding) before torchrec is called, raising :class:`UsageError` with one line that names the
key and what to do. This module imports neither torch nor torchrec, and a bad value
fails before :func:`validate` imports them, so it is reported before torch's slow import.

Each key's one-line help is its dataclass field's ``help`` metadata (:func:`_key`), which
``--help`` prints (:func:`help_text`): the one place a key is documented.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from itertools import takewhile
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
SCHEMAS = ("synthetic", "criteo", "movielens", "criteo_tsv")
MAX_LR = 100.0  # above this every optimizer offered diverges on every model here
#: the name of each group's schema in Hydra's ConfigStore (``<group>_schema``), no option to show
SCHEMA_SUFFIX = "_schema"
#: the resolver that configs/train.yaml's ``hydra.help.template`` calls (:func:`help_text`)
HELP_RESOLVER = "recpipe_help"


class UsageError(Exception):
    """Something the user can fix (a config value, a checkpoint directory, a data file): the
    message is one line saying what is wrong and what to do. ``scripts/train.py`` prints it
    without a traceback and exits non-zero, naming ``checkpoint`` (step directory, checkpoint
    directory) to resume from where the trainer set it (a data file failing mid-run)."""

    checkpoint: tuple[str, str] | None = None
    #: every rank raised it at the same step, by agreement (the trainer's per-step decision)
    together: bool = False


def _key(default: Any, help: str) -> Any:
    """A config key: its default and its one-line ``help``, which ``--help`` prints
    (:func:`help_text`); a list default is copied for each instance."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    num_tables: int = _key(4, "embedding tables per sparse module (data=synthetic)")
    rows: int = _key(1000, "rows per embedding table (criteo_tsv: hash buckets per id column)")
    dim: int = _key(16, "embedding dimension of every table (a multiple of 4)")
    weighted: bool = _key(True, "a weighted EmbeddingBagCollection too (data=synthetic)")
    sequence: bool = _key(True, "an EmbeddingCollection too (data=synthetic)")
    over_arch: list[int] = _key([64], "hidden widths of the over-arch MLP (not criteo_tsv)")


@dataclass
class DataConfig:
    schema: str = _key("synthetic", "synthetic | criteo (synthetic, Criteo's 13 dense + 26 "
                                    "sparse features) | movielens | criteo_tsv")
    batch_size: int = _key(64, "samples per rank and step")
    pooling: int = _key(4, "mean ids per sample and feature (synthetic, criteo)")
    zipf: float = _key(1.1, "Zipf exponent of the ids (synthetic, criteo)")
    dense_in: int = _key(13, "dense features (data=synthetic)")
    seed: int = _key(0, "orders the batches (trainer.seed initializes the model)")
    path: str | None = _key(None, "movielens: the .npz (null: the default file); criteo_tsv: "
                                  "a TSV file or a directory of them")
    eval_fraction: float = _key(0.2, "the last fraction of the data, held out for evaluation "
                                     "(movielens, criteo_tsv)")
    max_history: int = _key(20, "movielens: cap on the user's earlier items per sample")
    label_scope: str = _key("earlier", "movielens: the labels the positive-rate features see: "
                                       "earlier (all earlier events) | train (the training part's)")


@dataclass
class ShardingConfig:
    types: list[str] = _key(["table_wise", "column_wise"],
                            f"the tables' sharding types, in turn: {' | '.join(SHARDING_TYPES)}")


@dataclass
class PipelineConfig:
    name: str = _key("recpipe", "the training pipeline: recpipe | torchrec")
    # recpipe's BucketedAllReduce, torchrec's DDP wrapper with a communication hook: nccl is DDP
    # itself; symm_mem sends every bucket it can through symmetric memory; auto: per bucket, the
    # faster of NCCL and the symmetric algorithms in the machine's measured table
    # (recpipe.ops.all_reduce_table), NCCL where nothing was measured; DDP's own buckets
    dense_allreduce: str = _key("ddp", "dense-gradient all-reduce: ddp (torchrec's) | nccl | "
                                       "symm_mem (CUDA, one node) | auto (the fastest measured)")


@dataclass
class HardwareConfig:
    device: str = _key("cpu", "where the ranks compute: cpu | cuda (one GPU per rank)")
    backend: str = _key("gloo", "the process group's backend: gloo | nccl (with cuda)")
    # recpipe.pipeline.topology's INTRA_NODE_GB_S (H200 NVLink) and INTER_NODE_GB_S (a 400 Gb/s
    # NIC per GPU): tests check the defaults equal them
    intra_node_gb_s: float = _key(450.0, "the planner's link bandwidth inside a node, GB/s per "
                                         "GPU and direction")
    inter_node_gb_s: float = _key(50.0, "the planner's link bandwidth across nodes, GB/s per "
                                        "GPU and direction")


@dataclass
class TrainerConfig:
    steps: int = _key(300, "train to this step (counted from the run's start, resumed or not)")
    lr: float = _key(0.05, f"learning rate (finite, > 0, <= {MAX_LR:g})")
    optimizer: str = _key("sgd", "sgd | adagrad")
    log_interval: int = _key(25, "steps between progress lines (metrics rows)")
    seed: int = _key(1, "initializes the model (data.seed orders the batches)")
    checkpoint_dir: str | None = _key(None, "where checkpoints go (null: <run dir>/checkpoint)")
    checkpoint_interval: int = _key(1000, "a checkpoint every N steps (0: not by steps); also at "
                                          "the end and on SIGINT/SIGTERM")
    checkpoint_minutes: float = _key(10.0, "a checkpoint every N minutes of wall time (0: not by "
                                           "time), whichever of the two comes first")
    keep_checkpoints: int = _key(3, "the newest N complete checkpoints stay (0: all)")
    checkpoint: bool = _key(True, "false: write no checkpoint at all (benchmark runs)")
    resume: bool = _key(False, "continue checkpoint_dir's latest checkpoint (same config, "
                               "steps beyond it)")
    resume_other_data: bool = _key(False, "resume even where the data files differ from those "
                                          "the checkpoint trained on")
    overwrite: bool = _key(False, "a fresh run may delete the checkpoints already in "
                                  "checkpoint_dir")
    stop_after: int | None = _key(None, "stop (as if interrupted) after this step")
    eval: bool = _key(True, "evaluate on the data's held-out batches")
    eval_interval: int = _key(0, "steps between evaluations (0: at the end only)")
    deterministic: bool = _key(False, "deterministic GPU kernels: repeatable losses, slower")


@dataclass
class TrainConfig:
    model: ModelConfig = _key(MISSING, "the model's tables and MLP")
    data: DataConfig = _key(MISSING, "the data set and its batches")
    sharding: ShardingConfig = _key(MISSING, "how the embedding tables are sharded")
    pipeline: PipelineConfig = _key(MISSING, "the training pipeline and dense all-reduce")
    hardware: HardwareConfig = _key(MISSING, "the device, backend and links")
    trainer: TrainerConfig = _key(MISSING, "steps, optimizer, checkpoints, evaluation")
    output_dir: str = _key("outputs", "where run directories go (<output_dir>/<time>-<pipeline>/)")


def _groups() -> dict[str, type]:
    """The config groups (:class:`TrainConfig`'s fields that are config dataclasses): name,
    dataclass."""
    return {k: v for k, v in get_type_hints(TrainConfig).items() if is_dataclass(v)}


def register() -> None:
    """Register the schemas with Hydra (``configs/*/*.yaml`` extend them) and ``--help``'s
    resolver (:data:`HELP_RESOLVER`)."""
    cs = ConfigStore.instance()
    cs.store(name=f"train{SCHEMA_SUFFIX}", node=TrainConfig)
    for group, node in _groups().items():
        cs.store(group=group, name=f"{group}{SCHEMA_SUFFIX}", node=node)
    OmegaConf.register_new_resolver(HELP_RESOLVER, _help_template, replace=True)


def _help_template(*, _root_: DictConfig) -> str:
    """:func:`help_text` for Hydra's help template, a string.Template (``$`` doubled)."""
    return help_text(_root_).replace("$", "$$")


def help_text(root: DictConfig) -> str:
    """``--help``'s body for ``root``, the config Hydra composed from the command line: each
    group with this command line's option, its help and its options (not Hydra's list, which
    holds the ``*_schema`` entries), then every key with this command line's value and its help
    (the fields' ``help`` metadata)."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    helps = {f.name: f.metadata["help"] for f in fields(TrainConfig)}
    groups, keys = [], []
    for group, schema in _groups().items():
        options = sorted(o for o in loader.get_group_options(group)
                         if not o.endswith(SCHEMA_SUFFIX))
        groups.append((f"{group}={root.hydra.runtime.choices[group]}",
                       f"{helps.pop(group)}: {', '.join(options)}"))
        values = OmegaConf.to_container(root[group], resolve=True)
        keys += [(f"{group}.{f.name}={_shown(values[f.name])}", f.metadata["help"])
                 for f in fields(schema)]
    keys += [(f"{k}={_shown(root[k])}", h) for k, h in helps.items()]  # the top-level keys
    return (f"== Groups (GROUP=OPTION: this command line's; then the options) ==\n"
            f"{_table(groups)}\n== Keys (KEY=VALUE: this command line's value) ==\n{_table(keys)}")


def _shown(value: Any) -> str:
    """``value`` as an override writes it: ``true``, ``null``, ``[64,32]``."""
    if isinstance(value, list):
        return f"[{','.join(map(_shown, value))}]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _table(rows: list[tuple[str, str]], widest: int = 36) -> str:
    """``rows`` as lines, the second column aligned (after a first column of up to ``widest``
    characters)."""
    width = min(max(len(a) for a, _ in rows), widest)
    return "".join(f"{a:<{width}}  {b}\n" for a, b in rows)


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
    torchrec (slow to import), which only a config valid so far waits for."""
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
            names = [x.strip() for x in names if not x.endswith(SCHEMA_SUFFIX)]
            return f"{lines[0]}: pick one of {', '.join(names)}"
        cause = e.__cause__ and str(e.__cause__).splitlines()[0]
        if cause:  # a key typo, a wrong type: OmegaConf's reason
            return f"{lines[0].rstrip('.')}: {cause} (the keys and types: recpipe.train.config)"
        return " ".join(x.strip() for x in lines[:2])  # the override grammar
    return unknown_key(cfg)


def unknown_key(cfg: DictConfig, schema: type = TrainConfig, prefix: str = "") -> str | None:
    """One line for the first key of ``cfg`` that the config dataclass ``schema`` lacks (at
    ``prefix``), looking into its groups, naming the closest key or else its level's keys; None
    if there is none. ``+key=value`` adds such a key: Hydra composes it, and the job would
    ignore it."""
    types = get_type_hints(schema)
    for key in cfg:
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)  # names, not the prefix
            hint = (f"did you mean {prefix}{close[0]}?" if close else
                    f"the keys are {', '.join(prefix + k for k in sorted(types))}")
            return f"no {'' if prefix else 'top-level '}config key {prefix + key!r}: {hint}"
        if is_dataclass(types[key]):
            error = unknown_key(cfg[key], types[key], f"{prefix}{key}.")
            if error:
                return error
    return None
