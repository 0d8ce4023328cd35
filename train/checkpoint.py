"""Checkpoints that never lie: a run's checkpoint directory, its lock, saves and resume checks.

Layout of ``trainer.checkpoint_dir``::

    .lock              flock'd by rank 0 for the run's life (the OS releases it on kill -9)
    latest             the step of the newest complete checkpoint (written atomically, last)
    step_<N>/          DCP files and .metadata (every rank), then, by rank 0:
        meta.json      step, world size and ranks per node, the config identity
                       (:func:`identity`) and its hash, the data's (:func:`data_identity`)
        metrics.jsonl  the run's metrics rows up to step N (a resumed run continues them)
        window.pt      the steps since the last metrics row (rank 0's losses, every rank's
                       logits and labels), so that a resumed run logs the rows of an
                       uninterrupted one (absent in checkpoints of earlier versions)
        sha256sums     sha256 of every other file here (``sha256sum -c sha256sums`` checks it)

A save is complete when ``sha256sums`` exists: it is written after the DCP save returned on every
rank (``.metadata`` present), and ``latest`` moves only after it. So ``latest`` never names a
partial checkpoint, whatever is killed when; a save that fails (a full disk) removes its
partial ``step_N/`` (:meth:`CheckpointDir.save`), so that freeing the space it needs is enough
to resume. Resume (:meth:`CheckpointDir.open`) refuses, with a :class:`CheckpointError` naming
the problem and the fix, a missing/empty/garbage ``latest``, an
incomplete or corrupt checkpoint, another config (the keys that shape the run,
:func:`identity`; changing any other key resumes), other data (what the data files hold,
:func:`data_identity`, wherever they lie; ``trainer.resume_other_data=true`` accepts it),
``steps`` not beyond the checkpoint, and (at load) a model or world size DCP cannot reshard to.
Another node count of the same world size (say 2 nodes x 2 ranks saved, 1 node x 4 resuming)
changes only the plan: DCP reshards it. A fresh run refuses a directory that already holds
checkpoints unless ``trainer.overwrite=true``.

Rank 0 alone reads and writes these files (the directory is shared, as DCP requires); every
decision is broadcast, so all ranks raise the same error and none waits for another.

DCP and empty optimizer state: torchrec's fused SGD has a state dict of empty dicts, one per
table. DCP saves no key for an empty dict, and when a rank lacks some saved keys (another rank's
table-wise tables) its loader falls back to the pre-2.4 flattening, which turns the empty dicts
into a leaf key the checkpoint lacks ("Missing key in checkpoint state_dict: fused_optimizer").
:func:`_tensor_branches` keeps only the branches that hold data, on save and load alike.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from recpipe.train.config import DataConfig, TrainConfig, UsageError
from recpipe.train.data import data_files, source_keys
from recpipe.pipeline.topology import NodeLayout, node_layout

log = logging.getLogger(__name__)

LATEST, LOCK, META, SUMS, HISTORY = "latest", ".lock", "meta.json", "sha256sums", "metrics.jsonl"
WINDOW = "window.pt"
#: tests only: the save of this step sleeps after the DCP save, before sha256sums and ``latest``
PAUSE_ENV = "RECPIPE_TEST_PAUSE_BEFORE_LATEST"

T = TypeVar("T")


class CheckpointError(UsageError):
    """A checkpoint directory that cannot be used as asked; the message says why and what to do."""


def identity(cfg: TrainConfig) -> dict[str, Any]:
    """The config keys a resumed run must share with its checkpoint: the model and data keys
    that ``data.schema``'s source reads (:func:`~.data.source_keys`: a key the source ignores,
    say ``model.num_tables`` with MovieLens, may change) and the training math; not steps,
    intervals, output paths, pipeline or hardware."""
    values = {f"{group}.{k}": v for group in ("model", "data")
              for k, v in asdict(getattr(cfg, group)).items()}
    out = {key: values[key] for key in source_keys(cfg.data.schema)}
    out.update({f"trainer.{k}": getattr(cfg.trainer, k) for k in ("lr", "optimizer", "seed")})
    return out


def config_hash(ident: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DataIdentity:
    """What a run's data files hold, as a checkpoint records it (``meta.json``'s ``data``)."""

    path: str  # data.path, or the default file it stands for (for people; not compared)
    size: int  # bytes, the files together
    #: one file's sha256 (as ``sha256sum`` prints it); a directory's files': the sha256 of
    #: their ``sha256sum`` listing (file names, in the source's order)
    sha256: str
    #: per file, when it was hashed: (device, inode, size, mtime_ns, ctime_ns)
    stats: tuple[tuple[int, ...], ...]

    def __str__(self) -> str:
        return f"{self.path}: {self.size} bytes, sha256 {self.sha256[:12]}"

    def same_content(self, other: DataIdentity) -> bool:
        return (self.size, self.sha256) == (other.size, other.sha256)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DataIdentity:
        return cls(d["path"], d["size"], d["sha256"], tuple(map(tuple, d["stats"])))


def data_identity(data: DataConfig, known: DataIdentity | None = None) -> DataIdentity | None:
    """The identity of the files ``data.schema``'s source reads (:func:`~.data.data_files`);
    None for generated data, which its config keys (:func:`identity`) decide, and for files
    that cannot be read (the source says why, when it is made).

    Hashing costs a pass over the bytes (as criteo_tsv's own line count), so a run hashes once
    (rank 0, when its checkpoint directory opens; :class:`CheckpointDir` keeps it for every
    save), and the checkpoint is the cache: ``known``, the identity the checkpoint to resume
    recorded, is taken as it is while every file's stat key is the one recorded. Any write or
    replacement changes that key: a replaced file has a new inode, and the ctime moves on every
    write, rename or chmod, which no user can set back (``touch -d`` and ``cp -p`` set the mtime
    only). So a resume on unchanged data reads no byte of it, and no cache file can go stale:
    none is kept beside the data (a read-only directory; in a Criteo directory every visible
    file is read) or anywhere else. A file copied elsewhere, or only touched, is hashed again
    and, holding the same bytes, resumes."""
    try:
        files = data_files(data)
        if files is None:
            return None
        stats = tuple(_stat_key(f) for f in files)
        shown = data.path or str(files[0])
        if known is not None and known.stats == stats:
            return dataclasses.replace(known, path=shown)
        hashes = [_sha256(str(f)) for f in files]
    except OSError:
        return None
    listing = "".join(f"{h}  {f.name}\n" for h, f in zip(hashes, files))
    digest = hashes[0] if len(files) == 1 else hashlib.sha256(listing.encode()).hexdigest()
    return DataIdentity(shown, sum(st[2] for st in stats), digest, stats)


def _stat_key(path: Path) -> tuple[int, ...]:
    """What changes when ``path``'s file is written or replaced (:func:`data_identity`)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class Checkpoint:
    """What a complete checkpoint records (``meta.json``)."""

    path: str
    step: int
    layout: NodeLayout  # the world size and ranks per node that saved it
    config: dict[str, Any]  # its identity (meta.json also records its hash, for people)
    data: DataIdentity | None  # None: generated data, or a checkpoint of an earlier version

    def history(self) -> list[dict]:
        """The run's metrics rows up to this checkpoint's step."""
        with open(os.path.join(self.path, HISTORY)) as f:
            return [json.loads(line) for line in f if line.strip()]

    def window(self) -> dict[str, torch.Tensor] | None:
        """The metrics window at this step (what :meth:`CheckpointDir.save` got); None in a
        checkpoint of an earlier version, which kept none."""
        path = os.path.join(self.path, WINDOW)
        return torch.load(path, weights_only=True) if os.path.exists(path) else None


class CheckpointDir:
    """One run's checkpoint directory (see the module docstring). Use :meth:`open`."""

    def __init__(self, path: str, cfg: TrainConfig) -> None:
        self.path = path
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.layout = node_layout(self.world)
        self._ident = identity(cfg)
        self._data: DataIdentity | None = None  # rank 0's, once :meth:`_prepare` ran
        self._keep = cfg.trainer.keep_checkpoints
        self._lock: int | None = None
        #: the checkpoint to resume from (``open(..., resume=True)``), else None
        self.resume: Checkpoint | None = None

    @classmethod
    @contextmanager
    def open(cls, path: str, cfg: TrainConfig) -> Iterator[CheckpointDir]:
        """All ranks: lock ``path`` (rank 0) for the block and check it for ``cfg``: resume
        (``trainer.resume``) needs a complete checkpoint of the same config and data
        (:func:`data_identity`; other data with ``trainer.resume_other_data``) before
        ``trainer.steps``; a fresh run needs no checkpoints there (``trainer.overwrite=true``
        deletes them). Raises :class:`CheckpointError` on every rank."""
        self = cls(path, cfg)
        try:
            self.resume = _agree(lambda: self._prepare(cfg))
            yield self
        finally:
            if self._lock is not None:
                os.close(self._lock)  # releases the flock

    def _prepare(self, cfg: TrainConfig) -> Checkpoint | None:
        t = cfg.trainer
        if t.resume and not os.path.isdir(self.path):
            raise CheckpointError(f"no checkpoint directory {self.path}: check "
                                  "trainer.checkpoint_dir, or drop trainer.resume=true to start fresh")
        os.makedirs(self.path, exist_ok=True)
        self._acquire_lock()
        if t.resume:
            ckpt = self._verified(self._latest())
            for key, value in (("trainer.steps", t.steps), ("trainer.stop_after", t.stop_after)):
                if value is not None and value <= ckpt.step:
                    raise CheckpointError(
                        f"{key}={value} but {ckpt.path} is at step {ckpt.step}: pass {key} above "
                        f"{ckpt.step} to train further (steps count from the run's start)")
            self._data = self._resumed_data(ckpt, cfg)
            return ckpt
        steps = self._steps()
        if steps or os.path.exists(os.path.join(self.path, LATEST)):
            if not t.overwrite:
                raise CheckpointError(
                    f"{self.path} already holds checkpoints ({_names(steps) or LATEST}): continue "
                    "them with trainer.resume=true, start over with trainer.overwrite=true "
                    "(deletes them), or use another trainer.checkpoint_dir")
            self._remove_all(steps)
        self._data = data_identity(cfg.data)
        return None

    def _resumed_data(self, ckpt: Checkpoint, cfg: TrainConfig) -> DataIdentity | None:
        """The data's identity, if it is ``ckpt``'s (or ``ckpt`` recorded none); other data
        raises :class:`CheckpointError` unless ``trainer.resume_other_data``."""
        here = data_identity(cfg.data, ckpt.data)
        if ckpt.data is None or here is None or here.same_content(ckpt.data):
            return here
        if not cfg.trainer.resume_other_data:
            raise CheckpointError(
                f"{ckpt.path} was trained on other data ({ckpt.data}; now {here}): put that "
                "data back, or pass trainer.resume_other_data=true to continue on this data")
        log.info("%s was trained on other data (%s; now %s): continuing on this data "
                 "(trainer.resume_other_data=true)", ckpt.path, ckpt.data, here)
        return here

    def _acquire_lock(self) -> None:
        lock = os.path.join(self.path, LOCK)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"{self.path} is in use by another run ({owner}): wait for it to finish, or use "
                "another trainer.checkpoint_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._lock = fd

    def _steps(self) -> list[int]:
        """Steps of the ``step_<N>`` directories, complete or not, ascending."""
        return sorted(
            int(name[5:]) for name in os.listdir(self.path)
            if name.startswith("step_") and name[5:].isdigit()
        )

    def step_dir(self, step: int) -> str:
        """Where step ``step`` is (or would be) saved."""
        return os.path.join(self.path, f"step_{step}")

    def _complete(self) -> list[int]:
        return [s for s in self._steps() if os.path.exists(os.path.join(self.step_dir(s), SUMS))]

    def _fix(self, broken: int | None = None) -> str:
        """What to do about an unusable ``latest`` (naming step ``broken``)."""
        complete = [s for s in self._complete() if s != broken]
        other = (f"write the step of a complete checkpoint ({_names(complete)}) into "
                 f"{self.path}/latest, or " if complete else "")
        return f"{other}start over: drop trainer.resume, add trainer.overwrite=true"

    def _latest(self) -> int:
        path = os.path.join(self.path, LATEST)
        if not os.path.exists(path):
            raise CheckpointError(f"{self.path} has no 'latest' file (no complete checkpoint): "
                                  f"{self._fix()}")
        with open(path) as f:
            text = f.read().strip()
        if not text.isdigit():
            what = "is empty" if not text else f"holds {text[:40]!r}, not a step number"
            raise CheckpointError(f"{path} {what}: {self._fix()}")
        return int(text)

    def _verified(self, step: int) -> Checkpoint:
        """The complete, intact checkpoint of ``step`` with this run's config."""
        d = self.step_dir(step)
        if not os.path.isdir(d):
            raise CheckpointError(f"{self.path}/latest names step {step} but {d} does not exist: "
                                  f"{self._fix(step)}")
        for name, what in ((".metadata", "DCP's .metadata"), (SUMS, SUMS), (META, META)):
            if not os.path.exists(os.path.join(d, name)):
                raise CheckpointError(f"{d} is incomplete (no {what}): {self._fix(step)}")
        bad = _sums_mismatch(d)
        if bad:
            raise CheckpointError(f"{d} is corrupt ({bad} does not match {SUMS}): {self._fix(step)}")
        try:
            with open(os.path.join(d, META)) as f:
                meta = json.load(f)
            layout = NodeLayout(meta["world_size"], meta.get("local_world_size", meta["world_size"]))
            data = DataIdentity.from_json(meta["data"]) if meta.get("data") else None
            ckpt = Checkpoint(d, meta["step"], layout, meta["config"], data)
        except (ValueError, KeyError, TypeError) as e:  # sha256sums rewritten to match (LayoutError too)
            raise CheckpointError(f"{d}/{META} is unreadable ({e!r}): {self._fix(step)}") from None
        # the keys this run's identity has (a checkpoint of an earlier version records more)
        diffs = [f"{k}={ckpt.config.get(k)!r} there, {v!r} here"
                 for k, v in self._ident.items() if ckpt.config.get(k) != v]
        if diffs:
            raise CheckpointError(
                f"{d} is of another configuration ({'; '.join(diffs[:3])}): resume with the "
                "checkpoint's values, or train afresh in another trainer.checkpoint_dir")
        return ckpt

    def _remove_all(self, steps: list[int]) -> None:
        """Delete ``latest`` first (so it never names a deleted step), then the step dirs."""
        latest = os.path.join(self.path, LATEST)
        if os.path.exists(latest):
            os.remove(latest)
        for step in steps:
            _remove_step(self.step_dir(step))
        log.info("overwrite: deleted the checkpoints in %s", self.path)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             history: list[dict], window: dict[str, torch.Tensor] | None) -> None:
        """All ranks: save step ``step`` (model, dense and fused optimizer state); rank 0 then
        writes ``meta.json``, ``history`` (this run's rows up to ``step``), ``window`` (the
        steps since the last row, rank 0's; ignored on other ranks), ``sha256sums`` and, last,
        ``latest``; older checkpoints beyond ``keep_checkpoints`` go. A save that fails where
        no rank writes into ``step_N/`` any more (DCP raised, which it does on every rank; rank
        0's sealing failed after every rank's DCP files were written) leaves no partial
        ``step_N/`` (:meth:`_discard`), so that the space a user frees is enough to resume."""
        d = self.step_dir(step)
        if self.rank == 0 and os.path.exists(d):  # a save an earlier, killed run left unfinished
            _remove_step(d)
        dist.barrier()
        try:
            dcp.save(_state(model, optimizer), checkpoint_id=d)
        except CheckpointException:  # on every rank, once each rank's writes have returned
            self._discard(step)
            raise
        dist.barrier()  # every rank's files and the .metadata are written
        if self.rank == 0:
            if os.environ.get(PAUSE_ENV) == str(step):
                time.sleep(3600)
            try:
                self._seal(d, step, history, window)
            except Exception:  # a full disk: the other ranks wait at the barrier, writing nothing
                self._discard(step)
                raise
        dist.barrier()

    def _discard(self, step: int) -> None:
        """Rank 0, after a failed save of ``step``: remove its partial ``step_N/``, never a
        complete checkpoint (``sha256sums`` present) nor the one ``latest`` names. Where that
        fails too (a read-only file system), the directory stays: the save's error is the one
        to report, and the next save of that step replaces it."""
        d = self.step_dir(step)
        if self.rank != 0 or os.path.exists(os.path.join(d, SUMS)) or self._maybe_latest(step):
            return
        shutil.rmtree(d, ignore_errors=True)

    def _maybe_latest(self, step: int) -> bool:
        """Whether ``latest`` names ``step``, or cannot be read to tell (no ``latest``: no)."""
        try:
            with open(os.path.join(self.path, LATEST)) as f:
                return f.read().strip() == str(step)
        except FileNotFoundError:
            return False
        except OSError:
            return True

    def _seal(self, d: str, step: int, history: list[dict],
              window: dict[str, torch.Tensor] | None) -> None:
        if not os.path.exists(os.path.join(d, ".metadata")):
            raise RuntimeError(f"{d}: DCP returned without writing .metadata")
        meta = {"step": step, "world_size": self.world,
                "local_world_size": self.layout.local_world_size,
                "config_hash": config_hash(self._ident), "config": self._ident,
                "data": asdict(self._data) if self._data else None}
        _write(os.path.join(d, META), json.dumps(meta, indent=1) + "\n")
        _write(os.path.join(d, HISTORY), "".join(json.dumps(r) + "\n" for r in history))
        torch.save(window, os.path.join(d, WINDOW))  # sealed by sha256sums, like the rest
        sums = "".join(f"{_sha256(os.path.join(d, n))}  {n}\n" for n in sorted(os.listdir(d)))
        _write(os.path.join(d, SUMS), sums)
        _write(os.path.join(self.path, LATEST), str(step))
        log.debug("checkpoint %s", d)
        self._prune(step)

    def _prune(self, latest: int) -> None:
        """Keep the newest ``keep_checkpoints`` complete checkpoints up to ``latest`` and any
        unfinished save beyond it (a later save of that step replaces it)."""
        complete = self._complete()
        keep = set(complete[-self._keep:] if self._keep else complete) | {latest}
        for step in self._steps():
            if step < latest and step not in keep:
                _remove_step(self.step_dir(step))

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """All ranks: load :attr:`resume` into ``model`` and ``optimizer`` in place. DCP reshards
        to this world size where it can; where it cannot (or the model's shapes differ) every
        rank raises :class:`CheckpointError`."""
        ckpt = self.resume
        assert ckpt is not None, "load() needs open(..., resume=True)"
        state = _state(model, optimizer)
        try:
            dcp.load(state, checkpoint_id=ckpt.path)
        except (Exception, CheckpointException) as e:  # DCP: every rank's failures, on all ranks
            reason = _reason(e)
            if ckpt.layout.world_size != self.world:
                raise CheckpointError(
                    f"{ckpt.path} (world size {ckpt.layout.world_size}: {ckpt.layout}) cannot be "
                    f"resharded to world size {self.world} ({reason}): resume with "
                    f"{ckpt.layout.world_size} ranks") from None
            raise CheckpointError(f"{ckpt.path} does not fit this model ({reason}): resume with "
                                  "the checkpoint's model and data config") from None
        model.load_state_dict(_merged(model.state_dict(), state["model"]))
        optimizer.load_state_dict(_merged(optimizer.state_dict(), state.get("optimizer", {})))
        fused = model.fused_optimizer
        fused.load_state_dict(_merged(fused.state_dict(), state.get("fused_optimizer", {})))
        if ckpt.layout != self.layout:
            log.info("resharded %s from %s to %s", ckpt.path, ckpt.layout, self.layout)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds, without branches that hold no data (module docstring)."""
    return _tensor_branches({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "fused_optimizer": model.fused_optimizer.state_dict(),
    })


def _tensor_branches(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` without the mappings that are empty or hold only empty mappings."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            value = _tensor_branches(value)
            if not value:
                continue
        out[key] = value
    return out


def _merged(full: dict[str, Any], loaded: Mapping[str, Any]) -> dict[str, Any]:
    """``full`` with the (nested) values of ``loaded`` written over it."""
    for key, value in loaded.items():
        if isinstance(value, Mapping) and isinstance(full.get(key), dict):
            _merged(full[key], value)
        else:
            full[key] = value
    return full


def _agree(fn: Callable[[], T]) -> T:
    """Rank 0 runs ``fn``; every rank returns its result or raises its CheckpointError (an
    OSError, e.g. a directory not writable, becomes one). Any other exception: rank 0 raises it,
    the others a CheckpointError naming it (none waits for a broadcast that never comes)."""
    outcome: list[Any] = [None, None]
    failed: Exception | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn()
        except CheckpointError as e:
            outcome[1] = str(e)
        except OSError as e:
            outcome[1] = f"checkpoint directory: {e}: fix it or use another trainer.checkpoint_dir"
        except Exception as e:  # noqa: BLE001 (raised again below, after the broadcast)
            failed, outcome[1] = e, f"rank 0 failed preparing the checkpoint directory: {e!r}"
    dist.broadcast_object_list(outcome, src=0)
    if failed is not None:
        raise failed
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


def _names(steps: list[int]) -> str:
    shown = [f"step_{s}" for s in steps[-3:]]
    return ", ".join(shown if len(steps) <= 3 else ["...", *shown])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sums_mismatch(d: str) -> str | None:
    """The first file of ``d`` whose sha256 differs from ``sha256sums`` (or that is missing
    from either side), else None."""
    listed = {}
    with open(os.path.join(d, SUMS)) as f:
        for line in f:
            digest, _, name = line.rstrip("\n").partition("  ")
            if not name:
                return SUMS  # garbled
            listed[name] = digest
    present = set(os.listdir(d)) - {SUMS}
    for name in sorted(present | set(listed)):
        if name not in listed or name not in present or _sha256(os.path.join(d, name)) != listed[name]:
            return name
    return None


def _write(path: str, text: str) -> None:
    """Atomically: a temporary file, fsync'd, renamed over ``path``, the directory fsync'd."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_step(d: str) -> None:
    """Remove ``sha256sums`` first: a half-removed step directory is never taken as complete."""
    sums = os.path.join(d, SUMS)
    if os.path.exists(sums):
        os.remove(sums)
    shutil.rmtree(d)


def first_failure(e: BaseException) -> BaseException:
    """``e``, or where it is DCP's CheckpointException (every failing rank's errors), the first
    rank's error."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]  # (exception, traceback)
    return e


def _reason(e: BaseException) -> str:
    """A (DCP) exception's message on one line: a CheckpointException's first rank's error."""
    e = first_failure(e)
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]
