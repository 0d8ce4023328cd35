"""Train the DLRM-style model with torchrec's or recpipe's pipeline (Hydra config).

    python scripts/train.py                                    # 1 CPU process (gloo), ~15 s
    python scripts/train.py pipeline=torchrec trainer.steps=100
    python scripts/train.py trainer.resume=true trainer.checkpoint_dir=DIR   # continue a run
    torchrun --nproc-per-node=2 scripts/train.py hardware=cuda
    python scripts/train.py -m pipeline=torchrec,recpipe       # a sweep (Hydra multirun)

Configs: configs/ (groups model, data, sharding, pipeline, hardware, trainer); the schema and
value checks: recpipe.train.config. Output (rank 0): <output_dir>/<time>-<pipeline>/
with config.yaml, metrics.jsonl and checkpoint/ (unless trainer.checkpoint_dir is given).

A usage problem (a key or value Hydra cannot compose, a bad value, an option this machine cannot
run, a checkpoint directory that cannot be used as asked, a diverged loss) ends the run with one
line ``error: ...`` and exit status 1. SIGINT/SIGTERM finish the current step, save a checkpoint and end with one line naming
it and the command that resumes it (exit status 130/143).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import warnings

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from recpipe.train.config import UsageError, composition_error, register, validate

register()
log = logging.getLogger("recpipe")

#: FutureWarnings about torchrec 1.8's internals (its planner's defaults, its DDP arguments, the
#: ShardedTensors DCP loads), printed on every run: (module, message)
KNOWN_WARNINGS = (
    (r"torchrec\.distributed\.planner\.planners", "HeuristicalStorageReservation is known"),
    (r"torchrec\.distributed\.model_parallel", "`broadcast_buffers` is deprecated"),
    (r"torch\.distributed\.checkpoint\.", "Please use DTensor instead and we are deprecating ShardedTensor"),
)


def _console(rank: int) -> None:
    """recpipe's messages on stderr, bare, from rank 0 only; torchrec's known warnings off.
    Once per job: Hydra's job_logging=disabled turns off every logger that exists when a job
    starts (a multirun's second job finds recpipe's)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and (name + ".").startswith("recpipe."):
            logger.disabled = False
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    for module, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


#: launched by torchrun (else one process; read before the first job sets RANK for itself)
TORCHRUN = "RANK" in os.environ


def _init_distributed(backend: str) -> torch.device:
    if not TORCHRUN:  # plain `python scripts/train.py`: one process, a free port
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        init = {"store": store, "rank": 0, "world_size": 1}
    else:  # torchrun: its rendezvous
        init = {}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend, **init)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _resume_command(checkpoint_dir: str) -> str:
    """This run's command line, continuing from ``checkpoint_dir``."""
    skip = ("trainer.resume", "trainer.checkpoint_dir", "trainer.overwrite")
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].lstrip("+~") not in skip]
    world, local = os.environ["WORLD_SIZE"], os.environ.get("LOCAL_WORLD_SIZE", "1")
    python = shlex.quote(sys.executable)  # this environment's interpreter, not a bare `python`
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        launcher = python
    elif world == local:  # one node: --standalone rendezvous again
        launcher = f"{python} -m torch.distributed.run --standalone --nproc-per-node={local}"
    else:
        launcher = f"{python} -m torch.distributed.run [the same options]"
    args = [sys.argv[0], *overrides, f"trainer.checkpoint_dir={checkpoint_dir}", "trainer.resume=true"]
    return f"{launcher} {shlex.join(args)}"


def _run(dcfg: DictConfig) -> list[dict]:
    """Validate, start the process group, train; the metrics rows rank 0 logged."""
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    device = _init_distributed(cfg.hardware.backend)
    # imported once the config is valid: the trainer loads torchrec
    from recpipe.train.trainer import TrainingInterrupted, train

    try:
        return train(cfg, device)
    except TrainingInterrupted as e:
        where = (f"checkpoint {e.checkpoint}; resume with: {_resume_command(e.checkpoint_dir)}"
                 if e.checkpoint else "no checkpoint (trainer.checkpoint=false)")
        log.warning("interrupted (%s) after step %d: %s", signal.Signals(e.signum).name, e.step, where)
        raise SystemExit(128 + e.signum) from None
    finally:
        dist.destroy_process_group()


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(dcfg: DictConfig) -> None:
    rank = int(os.environ.get("RANK", "0"))
    _console(rank)
    try:
        rows = _run(dcfg)
    except UsageError as e:
        raise SystemExit(f"error: {e}" if rank == 0 else 1) from None
    except KeyboardInterrupt:
        log.warning("interrupted before training started: nothing saved")
        raise SystemExit(130) from None
    train_rows = [r for r in rows if "loss" in r]
    if train_rows:
        first, last = train_rows[0], train_rows[-1]
        log.info("done: loss %.4f -> %.4f, auc %.3f, %.0f samples/s", first["loss"], last["loss"],
                 last["auc"], last["samples_per_s"])


def _check_overrides(args: list[str]) -> None:
    """Exit with one line if Hydra cannot compose ``args`` (plain ``key=value`` overrides only:
    sweeps and Hydra's own flags are left to Hydra)."""
    if any(a.startswith("-") for a in args):
        return
    error = composition_error(CONFIGS, "train", args)
    if error:
        raise SystemExit(f"error: {error}" if int(os.environ.get("RANK", "0")) == 0 else 1)


if __name__ == "__main__":
    _check_overrides(sys.argv[1:])
    main()
