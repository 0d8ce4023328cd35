"""The training command line: train the DLRM-style model with torchrec's or recpipe's pipeline
(Hydra config). ``recpipe-train`` (the console script), ``python -m recpipe.train`` and, in a
source checkout, ``python scripts/train.py`` run :func:`main`:

    recpipe-train                                              # 1 CPU process (gloo)
    recpipe-train pipeline=torchrec trainer.steps=100
    recpipe-train trainer.resume=true trainer.checkpoint_dir=DIR    # continue a run
    recpipe-torchrun --standalone --nproc-per-node=2 -m recpipe.train hardware=cuda
    recpipe-train -m pipeline=torchrec,recpipe                 # a sweep (Hydra multirun)

Configs: the ``recpipe`` package's ``configs/`` (:data:`CONFIGS`: the checkout's top-level
``configs/``, package data in a wheel), groups model, data, sharding, pipeline, hardware,
trainer; the schema and value checks: recpipe.train.config. Output (rank 0):
<output_dir>/<time>-<pipeline>/ with config.yaml, metrics.jsonl and checkpoint/ (unless
trainer.checkpoint_dir is given).

Exit status and what is printed (rank 0, on stderr), from the first import on:

- 1, one line ``error: ...``: a usage problem (a key or value Hydra cannot compose, a bad value,
  an option this machine cannot run, a checkpoint or output directory that cannot be used as
  asked, a diverged loss); a config error fails before torch is imported.
- 1, one line ``error: ...`` naming the command that installs what is missing: Hydra or another
  package of the ``train`` extra (``pip install 'recpipe[train]'``), torchrec (on CPU and GPU).
- 1, one line ``error: ...`` naming a log file with the traceback: any other exception,
  ``BaseException`` subclasses such as DCP's CheckpointException too (``<run
  dir>/error-rank<R>.log``, or ``<output_dir>/`` before the run directory exists; a new file in
  the temporary directory where that cannot be written or before the config is read), in a
  user's words where they are known (``no space left on device: <dir>``), and the checkpoint to
  resume from with the command that resumes it. ``RECPIPE_TRACEBACK=1`` prints the traceback
  here instead.
- 130/143: SIGINT/SIGTERM finish the current step (or stop an evaluation), save a checkpoint and
  end with one line naming it and the command that resumes it (after the last step: the
  checkpoint alone).
- 0 at ``trainer.stop_after``: the last line names the checkpoint and the command that resumes it.

The resume command repeats how this run was started (:func:`_program`): ``python -m
recpipe.train``, the ``recpipe-train`` script, or ``python scripts/train.py``, with this
environment's interpreter (under torchrun: ``python -m recpipe.train.torchrun``, or ``python -m
torch.distributed.run`` for plain torchrun).

Under torchrun each rank exits with these statuses and writes its line into torchrun's error
file (``TORCHELASTIC_ERROR_FILE``). ``recpipe-torchrun`` (recpipe.train.torchrun) ends with that
line and the rank's status; plain torchrun exits 1 whenever a rank fails or it gets a signal and
prints its own report (ChildFailedError, or for a signal sent to torchrun its SignalException
traceback) after our line, which it names as the root cause.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import TYPE_CHECKING, NoReturn

from recpipe.train.torchrun import LAUNCHER_ENV

if TYPE_CHECKING:  # torch loads in 3 s: imported once the config is valid
    import torch

    from recpipe.train.trainer import TrainingInterrupted

try:  # the train extra's: where an import fails (or is interrupted), main() says so in one line
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from recpipe.train.config import UsageError, composition_error, register, unknown_key, validate
except BaseException as e:  # noqa: BLE001 (SystemExit and Ctrl-C too: main() ends with them)
    _import_failure: BaseException | None = e
else:
    _import_failure = None
    register()
log = logging.getLogger("recpipe")

#: set to 1: an unexpected exception's traceback on stderr, not in a file
TRACEBACK_ENV = "RECPIPE_TRACEBACK"

#: warnings about the libraries' internals, printed on every run (module, message, category):
#: torchrec 1.8's planner defaults, its DDP arguments, the ShardedTensors DCP loads; torchmetrics
#: indexing with a list when it gathers a metric state of unequal sizes over ranks (a resumed
#: run's AUC window), which torch 2.14 deprecates
KNOWN_WARNINGS = (
    (r"torchrec\.distributed\.planner\.planners", "HeuristicalStorageReservation is known", FutureWarning),
    (r"torchrec\.distributed\.model_parallel", "`broadcast_buffers` is deprecated", FutureWarning),
    (r"torch\.distributed\.checkpoint\.", "Please use DTensor instead and we are deprecating ShardedTensor",
     FutureWarning),
    (r"torchmetrics\.utilities\.distributed", "Using a non-tuple sequence for multidimensional indexing",
     UserWarning),
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
    for module, message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _quiet_torch() -> None:
    """Once torch is loaded: its log warnings off, errors on (torchrec 1.8 calls a deprecated
    torch.fx function), as when torch loaded before Hydra disabled every existing logger.
    ``TORCH_LOGS``, if set, decides instead."""
    if "TORCH_LOGS" not in os.environ:
        logging.getLogger("torch").setLevel(logging.ERROR)


#: launched by torchrun (else one process; read before the first job sets RANK for itself)
TORCHRUN = "RANK" in os.environ


def _rank() -> int:
    """This process's rank: torchrun's ``RANK``, or 0 (one process)."""
    return int(os.environ.get("RANK", "0"))


def _init_distributed(backend: str) -> torch.device:
    import torch
    import torch.distributed as dist

    if not TORCHRUN:  # plain `recpipe-train`: one process, a free port
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


#: the console script (pyproject.toml's [project.scripts]): run as itself, not by ``python``
CONSOLE_SCRIPT = "recpipe-train"


def _program() -> list[str]:
    """What starts this program again after the interpreter (or torchrun's options): ``-m
    recpipe.train`` when ``python -m`` started it (``__main__`` has a module spec), else the
    script that did (``sys.argv[0]``: ``scripts/train.py``, the ``recpipe-train`` script)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return ["-m", spec.name.removesuffix(".__main__")]
    return [sys.argv[0]]


def _resume_command(checkpoint_dir: str, step: int | None = None) -> str:
    """This run's command line, continuing from ``checkpoint_dir``; without
    ``trainer.stop_after`` where the checkpoint's ``step`` is at or past it (a resume with it
    would be refused)."""
    skip = ("trainer.resume", "trainer.checkpoint_dir", "trainer.overwrite")

    def kept(override: str) -> bool:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        past = key == "trainer.stop_after" and step is not None and value.isdigit() and int(value) <= step
        return key not in skip and not past

    overrides = [o for o in HydraConfig.get().overrides.task if kept(o)]
    world, local = os.environ["WORLD_SIZE"], os.environ.get("LOCAL_WORLD_SIZE", "1")
    python = shlex.quote(sys.executable)  # this environment's interpreter, not a bare `python`
    program = _program()
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        console = program[0] != "-m" and os.path.basename(program[0]) == CONSOLE_SCRIPT
        launcher = "" if console else python  # the console script names its interpreter
    else:
        module = "recpipe.train.torchrun" if LAUNCHER_ENV in os.environ else "torch.distributed.run"
        options = f"--standalone --nproc-per-node={local}" if world == local else "[the same options]"
        launcher = f"{python} -m {module} {options}"  # one node: --standalone rendezvous again
    args = [*program, *overrides, f"trainer.checkpoint_dir={checkpoint_dir}", "trainer.resume=true"]
    return f"{launcher} {shlex.join(args)}".lstrip()


def _end(status: int, line: str, together: bool = True) -> NoReturn:
    """End this rank with exit status ``status``: rank 0 prints ``line`` on stderr; under
    torchrun every rank writes it into its error file, whose message torchrun's failure report
    shows (instead of a link to torchrun's docs). ``together``: every rank ends at this point by
    agreement (a signal, a config error, the trainer's decision), so recpipe-torchrun reports
    rank 0's line; else this rank failed alone, maybe causing the others' failures."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # the format torchrun's own @record writes (its report shows py_callstack), the
        # status, which recpipe-torchrun exits with (torchrun may kill this rank while it exits),
        # and the time, by which it finds the first failure
        now = time.time()
        info = {"py_callstack": line, "timestamp": str(int(now)), "time": now, "status": status,
                "together": together}
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(status)


def _interrupted(e: TrainingInterrupted, steps: int) -> str:
    """The line for a run a signal stopped after step ``e.step`` (of ``steps``): its checkpoint
    and the command that resumes it; after the last step (in the final evaluation: nothing left
    to train) the checkpoint alone."""
    name = signal.Signals(e.signum).name
    if not e.checkpoint:
        return f"interrupted ({name}) after step {e.step}: no checkpoint (trainer.checkpoint=false)"
    if e.step == steps:
        return (f"interrupted ({name}) in the final evaluation: all {steps} steps are trained and "
                f"saved in checkpoint {e.checkpoint}")
    return (f"interrupted ({name}) after step {e.step}: checkpoint {e.checkpoint}; resume with: "
            f"{_resume_command(e.checkpoint_dir, e.step)}")


def _unexpected(exc: BaseException, directory: str | None, checkpoint: tuple[str, str] | None) -> str:
    """The ``error:`` line for an exception that is no usage error: its cause
    (:func:`_cause`), where its traceback went (:func:`_keep_traceback`) and, with
    ``checkpoint`` (step directory, checkpoint directory), how to resume."""
    where = _keep_traceback("".join(traceback.format_exception(exc)), directory)
    return f"error: {_cause(exc, directory)} ({where}){_resume_hint(checkpoint)}"


#: the errors of a full disk or quota
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _cause(exc: BaseException, directory: str | None) -> str:
    """``exc`` on one line: a full disk (or quota) in a user's words, ``no space left on device:
    <path>`` (the file or directory, else ``directory``); any other its type and the first line
    of its message."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return f"{exc.strerror[:1].lower()}{exc.strerror[1:]}: {exc.filename or directory}"
    what = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}{': ' * bool(what)}{what}"


def _resume_hint(checkpoint: tuple[str, str] | None) -> str:
    """``; the last checkpoint is ..., resume with: ...`` for ``checkpoint`` (step directory,
    checkpoint directory), or nothing."""
    if checkpoint is None:
        return ""
    name = os.path.basename(checkpoint[0].rstrip("/"))  # step_<N>: the checkpoint's layout
    step = int(name.removeprefix("step_")) if name.removeprefix("step_").isdigit() else None
    return f"; the last checkpoint is {checkpoint[0]}, resume with: {_resume_command(checkpoint[1], step)}"


def _keep_traceback(text: str, directory: str | None) -> str:
    """Write ``text`` (a traceback) into ``directory/error-rank<R>.log``, else (no
    ``directory``, or one that cannot be written: read-only, a full disk) into a new
    ``recpipe-error-rank<R>-*.log`` in the temporary directory; on stderr with
    ``RECPIPE_TRACEBACK=1`` or where neither can be written. Returns where, in words."""
    failed = ""
    if os.environ.get(TRACEBACK_ENV, "0") in ("", "0"):
        name = f"error-rank{_rank()}"
        try:
            path = _write_log(text, directory, name) or _write_temporary(text, f"recpipe-{name}-")
            return f"the traceback is in {path}; {TRACEBACK_ENV}=1 prints it here"
        except OSError as e:
            failed = f"; {tempfile.gettempdir()}: {e.strerror}"
    print(text, end="", file=sys.stderr, flush=True)
    return f"the traceback is above{failed}"


def _write_log(text: str, directory: str | None, name: str) -> str | None:
    """``text`` into ``directory/<name>.log``; returns that path, or None where there is no
    ``directory`` or it cannot be written (nothing is left of the attempt)."""
    if directory is None:
        return None
    path = os.path.join(directory, f"{name}.log")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path
    except OSError:
        with suppress(OSError):
            os.remove(path)
        return None


def _write_temporary(text: str, prefix: str) -> str:
    """``text`` into a new file ``<prefix>*.log`` in the temporary directory; returns its path."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _run(dcfg: DictConfig) -> None:
    """Validate, start the process group, train; ends the process on an interruption or an
    unexpected exception in training. A key the schema lacks (``+trainer.stepz=3``) raises
    :class:`UsageError` before torch loads: :func:`_check_overrides` leaves a multirun's (``-m``)
    overrides to Hydra, so each job checks its composed config."""
    error = unknown_key(dcfg)
    if error:
        raise UsageError(error)
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    device = _init_distributed(cfg.hardware.backend)
    # imported once the config is valid: the trainer loads torchrec
    import torch.distributed as dist

    from recpipe.train.trainer import RunFailed, TrainingInterrupted, train

    _quiet_torch()
    going_on = partial(_resume_command, step=cfg.trainer.stop_after)  # stopped at stop_after
    try:
        train(cfg, device, resume_command=going_on)
    except TrainingInterrupted as e:
        _end(128 + e.signum, _interrupted(e, cfg.trainer.steps))
    except RunFailed as e:
        _end(1, _unexpected(e.__cause__, e.run_dir or cfg.output_dir, e.checkpoint), e.together)
    except UsageError as e:  # here, before the process group goes: the other ranks see it after
        _end(1, f"error: {e}{_resume_hint(e.checkpoint)}", e.together)
    finally:
        dist.destroy_process_group()


#: the configs, for Hydra and :func:`composition_error`: ``configs/`` in the ``recpipe`` package's
#: folder, i.e. the checkout's top-level ``configs/`` (editable install, or scripts/gpu_env.sh's
#: folder of symlinks) or the wheel's package data. An absolute path: Hydra would read a relative
#: one ("../configs") as ``pkg://recpipe/configs``, which it loads only from an importable
#: package (an ``__init__.py`` in configs/).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _hydra_main(dcfg: DictConfig) -> None:
    """One job of Hydra's (:func:`main`): :func:`_run`, any failure outside training (the
    process group, the imports of torch and torchrec...) in one line too."""
    _console(_rank())
    with _caught(dcfg.output_dir):
        try:
            _run(dcfg)
        except UsageError as e:
            _end(1, f"error: {e}{_resume_hint(e.checkpoint)}")


@contextmanager
def _caught(directory: str | None) -> Iterator[None]:
    """The catch-all: an exception out of the block ends the process with one line. Ctrl-C:
    status 130; a package this environment lacks: :func:`_not_installed`; any other,
    ``BaseException`` subclasses too: :func:`_unexpected`, the traceback in ``directory`` (None:
    the temporary directory). SystemExit (:func:`_end`) passes; a broken pipe (``--help |
    head``: the reader left) ends with status 1, silently, as other commands do."""
    try:
        yield
    except SystemExit:
        raise
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # none again at exit
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        _end(130, "interrupted before training started: nothing saved")
    except BaseException as e:  # noqa: BLE001
        _end(1, _not_installed(e) or _unexpected(e, directory, None))


#: the top-level modules of the ``train`` extra (pyproject.toml) that the training imports
TRAIN_EXTRA = ("hydra", "omegaconf", "torchmetrics", "tqdm")


def _not_installed(e: BaseException) -> str | None:
    """The line for a package missing from this environment, naming the command that installs
    it: a module of the ``train`` extra, or torchrec (recpipe.pipeline's ImportError, named
    ``torchrec``, says how on CPU and GPU); None for any other exception."""
    if not isinstance(e, ImportError):
        return None
    package = (e.name or "").partition(".")[0]
    if package in TRAIN_EXTRA:
        return f"error: {e}: install the training app's packages: pip install 'recpipe[train]'"
    return f"error: {e}" if package == "torchrec" else None


def _check_overrides(args: list[str]) -> None:
    """Exit with one line if Hydra cannot compose ``args`` (plain ``key=value`` overrides only:
    sweeps and Hydra's own flags are left to Hydra)."""
    if any(a.startswith("-") for a in args):
        return
    error = composition_error(CONFIGS, "train", args)
    if error:
        _end(1, f"error: {error}")


def main() -> None:
    """The command line (``recpipe-train``, ``python -m recpipe.train``, ``scripts/train.py``):
    overrides Hydra cannot compose fail with one line, then Hydra runs the job(s). Whatever
    fails from this module's imports on ends in one line (:func:`_caught`)."""
    with _caught(None):
        if _import_failure is not None:
            raise _import_failure
        _check_overrides(sys.argv[1:])
        hydra.main(config_path=CONFIGS, config_name="train", version_base=None)(_hydra_main)()
