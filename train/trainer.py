"""The training job behind ``scripts/train.py``: one loop for 1 CPU process or N GPUs.

Rank 0 alone logs (on a terminal a progress bar with loss and samples/s; elsewhere a progress
line now and then, :class:`_Progress`; ``logging`` for the rest) and writes ``metrics.jsonl``
and ``config.yaml``; checkpoints go through :mod:`.checkpoint` (DCP, every rank, one
directory). Batch ``s`` of rank ``r`` is a function of (data seed, r, s) only (:mod:`.data`),
and a checkpoint keeps the steps not yet in a metrics row (:class:`_Window`), so a run resumed
at any step k logs the rows of an uninterrupted run, bit for bit (``samples_per_s`` aside).
Evaluation (``trainer.eval_interval`` and at the end) runs the source's held-out batches
through the model taken off the pipeline (``detach``/``attach``): the training losses are the
same with and without it. The last step is saved before its evaluation. A SIGINT/SIGTERM stops
an evaluation before its next batch (the final one too: the run ends interrupted, saved).

Every rank takes the same decisions at the same step: at world size > 1 one all-reduce of four
flags per step on a gloo group (a SIGINT/SIGTERM on any rank, a checkpoint due on rank 0's clock,
a non-finite loss at a log step, a data source or metrics log that raised), so that all ranks
stop, save or fail together.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from itertools import count

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from tqdm import tqdm

from recpipe.train.checkpoint import CheckpointDir, first_failure
from recpipe.train.config import TrainConfig, UsageError, save_yaml
from recpipe.train.data import DataSource, make_source
from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist as RecpipePipeline
from recpipe.testing.synthetic import build_sharded, deterministic_kernels
from recpipe.pipeline.topology import group_is_node_local, node_layout, planner_topology

PIPELINES = {"torchrec": TorchrecPipeline, "recpipe": RecpipePipeline}
#: the batches a pipeline reads before its first step (TrainPipelineSparseDist's fill)
FILL = 2

log = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run after step ``step`` (the last, ``trainer.steps``: in the
    final evaluation), saved in ``checkpoint`` (a step directory; None when
    ``trainer.checkpoint=false``). Raised on every rank."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, checkpoint_dir: str | None):
        super().__init__(f"{signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step
        self.checkpoint, self.checkpoint_dir = checkpoint, checkpoint_dir


class NonFiniteError(UsageError):
    """The loss or the weights became NaN/inf; nothing of that state was checkpointed. Raised
    on every rank at the same step."""

    together = True


class PeerFailed(UsageError):
    """Another rank's data source or metrics log raised mid-run (its line is the message):
    every rank stopped after the same step and saved it."""

    together = True


class RunFailed(Exception):
    """An unexpected exception (this one's ``__cause__``) ended the run on this rank.
    ``run_dir``: the run directory (None: the run failed before making it); ``checkpoint``: the
    newest checkpoint this run saved or resumed from, as (step directory, checkpoint
    directory), None if there is none; ``together``: every rank stopped at the same step by
    agreement (:meth:`_Trainer._stop_together`), else this rank failed alone."""

    def __init__(self, run_dir: str | None, checkpoint: tuple[str, str] | None, together: bool) -> None:
        super().__init__(f"the run failed (run directory {run_dir})")
        self.run_dir, self.checkpoint, self.together = run_dir, checkpoint, together


def make_run_dir(cfg: TrainConfig) -> str:
    """Rank 0 makes ``<output_dir>/<timestamp>-<pipeline>[-i]`` and tells the other ranks.
    Where it cannot (a read-only ``output_dir``, a full disk) every rank raises a
    :class:`~.config.UsageError` naming it."""
    made = [None, None]  # the path, or why it could not be made
    if dist.get_rank() == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in count():
            path = os.path.join(cfg.output_dir, f"{stamp}-{cfg.pipeline.name}" + (f"-{i}" if i else ""))
            try:
                os.makedirs(path)
                made[0] = path
                break
            except FileExistsError:  # another run took it
                continue
            except OSError as e:
                made[1] = (f"output_dir={cfg.output_dir}: cannot make the run directory {path} "
                           f"({e.strerror}: {e.filename}): use a writable output_dir")
                break
    dist.broadcast_object_list(made, src=0)
    if made[1] is not None:
        error = UsageError(made[1])
        error.together = True
        raise error
    return made[0]


def _resume_in_words(checkpoint_dir: str) -> str:
    """How to resume ``checkpoint_dir`` after ``trainer.stop_after``, for a caller of
    :func:`train` without a command line."""
    return (f"the same command, trainer.stop_after dropped or raised, and trainer.resume=true "
            f"trainer.checkpoint_dir={checkpoint_dir}")


def train(cfg: TrainConfig, device: torch.device, out_dir: str | None = None,
          resume_command: Callable[[str], str] = _resume_in_words) -> list[dict]:
    """Train to ``cfg.trainer.steps`` (from the checkpoint if ``resume``); all ranks.

    The checkpoint directory is locked and checked, the model built and the checkpoint loaded
    first; only then is ``out_dir`` (default: a new run directory, :func:`make_run_dir`)
    written: ``config.yaml`` and ``metrics.jsonl`` (a resumed run's starts with the
    checkpoint's rows, so it holds the whole history once). At ``trainer.stop_after`` the last
    line names the checkpoint and ``resume_command(checkpoint directory)``, the command line that
    continues it (the training command passes its own; the default says it in words). Returns the
    rows this run logged (rank 0; empty elsewhere). Raises, on every rank,
    :class:`~.config.UsageError` (a refused checkpoint or output directory, a non-finite loss)
    and :class:`TrainingInterrupted` after a SIGINT/SIGTERM (the step finished and saved). A
    failed checkpoint save raises :class:`RunFailed` on every rank if DCP failed (it raises on
    all), else on rank 0, its cause an ``OSError`` ENOSPC naming the checkpoint directory where
    the disk is full (:func:`_save_error`). A data source raising mid-run stops every
    rank after the step the pipeline was in, saved (:meth:`_Trainer._watched`), and so does
    one logging the metrics row: the failing rank raises its error (a UsageError's
    ``checkpoint`` names the save), the others :class:`PeerFailed`. On the rank where it
    happened, :class:`RunFailed` from any other exception, ``BaseException`` subclasses such as
    DCP's CheckpointException too (at world size 1 the last step completed is saved first,
    :meth:`_Trainer._saved_on_failure`)."""
    out, trainer = None, None
    try:
        with ExitStack() as stack:
            t = cfg.trainer
            stack.enter_context(deterministic_kernels(t.deterministic))
            signals = stack.enter_context(_stop_signals())
            ckpt = None
            if t.checkpoint_dir and (t.checkpoint or t.resume):
                ckpt = stack.enter_context(CheckpointDir.open(t.checkpoint_dir, cfg))
            trainer = _Trainer(cfg, device, signals, ckpt)
            out = out_dir or make_run_dir(cfg)
            if ckpt is None and t.checkpoint:
                ckpt = stack.enter_context(CheckpointDir.open(os.path.join(out, "checkpoint"), cfg))
            if dist.get_rank() == 0:
                os.makedirs(out, exist_ok=True)
                save_yaml(cfg, os.path.join(out, "config.yaml"))
                log.info("run dir: %s  (world size %d: %s, %s)", out, dist.get_world_size(),
                         trainer.layout, device)
            return trainer.run(out, ckpt if t.checkpoint else None, resume_command)
    except (TrainingInterrupted, KeyboardInterrupt, SystemExit):
        raise
    except UsageError as e:
        if trainer is not None and trainer.stopped_together:  # the steps trained are saved
            e.checkpoint, e.together = trainer.resumable(), True
        raise
    except BaseException as e:  # DCP's CheckpointException is no Exception
        together = trainer is not None and trainer.stopped_together
        raise RunFailed(out, trainer and trainer.resumable(), together) from e


class _Signals:
    """The first SIGINT/SIGTERM received (0: none); once an evaluation stopped on a signal, the
    one every rank stopped on (:meth:`_Trainer._evaluate`)."""

    signum = 0


@contextmanager
def _stop_signals() -> Iterator[_Signals]:
    """Within the block SIGINT and SIGTERM only set ``signum`` (the loop stops after its step);
    the previous handlers come back on exit. A signal the process ignores (a shell's background
    job ignores SIGINT) stays ignored; off the main thread nothing is installed."""
    got = _Signals()
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum: int, frame: object) -> None:
        got.signum = got.signum or signum

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)
              if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield got
    finally:
        for s, h in before.items():
            signal.signal(s, h)


class _Window:
    """The steps since the last metrics row, on one rank: its losses, logits and labels. A row
    is rank 0's mean loss over the window and the AUC over every rank's predictions in it
    (torchmetrics gathers them). A checkpoint keeps the window (:meth:`state`,
    :meth:`restore`), so a run resumed inside one logs the row an uninterrupted run logs."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        self.logits.append(logits.detach())
        self.labels.append(labels.detach())

    def auc(self) -> float:
        """All ranks: the AUC over every rank's window (probabilities, so that torchmetrics,
        which takes values in [0, 1] for probabilities, never mistakes logits for them)."""
        auroc = BinaryAUROC().to(self.logits[-1].device)
        auroc.update(torch.sigmoid(torch.cat(self.logits)), torch.cat(self.labels).long())
        return auroc.compute().item()

    def clear(self) -> None:
        for values in (self.losses, self.logits, self.labels):
            values.clear()

    def state(self, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor] | None:
        """All ranks (at world size > 1 one gather on ``group``): rank 0 gets the window as a
        checkpoint keeps it, on the CPU: its own losses, every rank's logits and labels;
        other ranks None."""
        mine = (_cat(self.logits).cpu(), _cat(self.labels).cpu())
        parts = [mine]
        if group is not None:
            parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, parts, dst=0, group=group)
        if parts is None:
            return None
        return {"losses": _cat([x.reshape(1) for x in self.losses]).cpu(),
                "logits": _cat([p[0] for p in parts]), "labels": _cat([p[1] for p in parts])}

    def restore(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        """Rank 0 of a resumed run: start with the checkpoint's window (:meth:`state`); the
        other ranks start empty."""
        self.losses = list(state["losses"].to(device).unbind())
        self.logits = [state["logits"].to(device)]
        self.labels = [state["labels"].to(device)]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.empty(0)


#: off a terminal: a progress line at the first metrics row, then at most one per this long
PROGRESS_SECONDS = 30.0


class _Progress:
    """Rank 0's progress: on a terminal (stderr) a tqdm bar; elsewhere (a log file, CI, SLURM)
    a log line ``step S/N: loss, auc, samples/s, eta`` at the first metrics row and then at the
    first row each :data:`PROGRESS_SECONDS`. Other ranks show nothing."""

    def __init__(self, rank: int, steps: int, start: int, name: str) -> None:
        self.steps = steps
        terminal = rank == 0 and sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=start, desc=name, unit="step") if terminal else None
        self.lines = rank == 0 and not terminal
        self.last_line = -float("inf")

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def row(self, row: dict, steps_per_s: float) -> None:
        """A metrics row was logged (``steps_per_s``: the training rate over its window)."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.0f}")
        elif self.lines and time.monotonic() - self.last_line >= PROGRESS_SECONDS:
            self.last_line = time.monotonic()
            eta = datetime.timedelta(seconds=round((self.steps - row["step"]) / steps_per_s))
            log.info("step %d/%d: loss %.4f, auc %.3f, %.0f samples/s, eta %s", row["step"],
                     self.steps, row["loss"], row["auc"], row["samples_per_s"], eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Trainer:
    """One run: the model, its pipeline, metrics and checkpoints (see :func:`train`)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, signals: _Signals,
                 ckpt: CheckpointDir | None) -> None:
        """Build the model; load ``ckpt.resume`` if there is one."""
        self.cfg, self.device, self.signals = cfg, device, signals
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = node_layout(self.world)
        self.failure: Exception | None = None  # this rank's data source or log raised it
        #: every rank stopped at one step: a rank's failure (saved), or a save DCP failed on all
        self.stopped_together = False
        self.save_failed = False  # a checkpoint save raised: not tried again (_saved_on_failure)
        t = cfg.trainer
        self.source: DataSource = make_source(cfg)
        allreduce = cfg.pipeline.dense_allreduce
        data_parallel = None  # torchrec's DDP
        if allreduce != "ddp":  # imported here: it loads inductor, for these runs only
            from recpipe.pipeline.data_parallel import BucketedAllReduce

            node_local = group_is_node_local(self.layout, dist.group.WORLD)
            data_parallel = BucketedAllReduce(algorithm=allreduce, node_local=node_local)
        hw = cfg.hardware
        topology = planner_topology(self.layout, device, hw.intra_node_gb_s, hw.inter_node_gb_s)
        self.model, self.optimizer = build_sharded(
            self.source.spec, list(cfg.sharding.types), device, dist.group.WORLD, lr=t.lr,
            seed=t.seed, optimizer=t.optimizer, data_parallel=data_parallel, topology=topology,
        )
        if data_parallel is not None and self.rank == 0:
            log.info("dense all-reduce %s: DDP's bucket cap %d bytes, %s", allreduce,
                     data_parallel.bucket_cap_bytes,
                     "NCCL for all" if data_parallel.hook is None else "NCCL or symmetric memory by size")
        resume = ckpt.resume if ckpt else None
        #: where checkpoints go (:meth:`run` sets the run's), and the newest step there
        self.ckpt, self.start = ckpt, resume.step if resume else 0
        self.saved = self.start
        if resume:
            ckpt.load(self.model, self.optimizer)
            log.info("resumed from %s", resume.path)
        #: rank 0: every metrics row of the run so far (a resumed run: the checkpoint's first)
        self.history = resume.history() if resume and self.rank == 0 else []
        self.window = _Window()
        window = resume.window() if resume and self.rank == 0 else None
        if window is not None:  # None: a checkpoint saved before windows were kept
            self.window.restore(window, device)
        self.control = dist.new_group(backend="gloo") if self.world > 1 else None

    def resumable(self) -> tuple[str, str] | None:
        """(step directory, checkpoint directory) of the newest checkpoint this run saved or
        resumed from; None if there is none."""
        if self.ckpt is None or not self.saved:
            return None
        return self.ckpt.step_dir(self.saved), self.ckpt.path

    def run(self, out: str, ckpt: CheckpointDir | None,
            resume_command: Callable[[str], str]) -> list[dict]:
        """Train, logging into ``out/metrics.jsonl`` and checkpointing into ``ckpt``; at
        ``trainer.stop_after`` the last line names ``resume_command`` (see :func:`train`)."""
        t = self.cfg.trainer
        self.ckpt, self.last_save = ckpt, time.monotonic()
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        if self.rank == 0:
            with open(self.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.history)
        stop = min(t.steps, t.stop_after or t.steps)
        pipeline = PIPELINES[self.cfg.pipeline.name](self.model, self.optimizer, self.device)
        it = self._watched(self.source.train_batches(self.rank, self.world, self.start, stop))
        rows, final_eval = [], None
        progress = _Progress(self.rank, t.steps, self.start, self.cfg.pipeline.name)
        self._clock = (time.perf_counter(), self.start)
        try:
            for step in range(self.start + 1, stop + 1):  # step: steps done after this one
                try:
                    self.window.add(*pipeline.progress(it))
                except StopIteration:  # a source's batches are as many as the steps asked
                    raise RuntimeError(f"the data source ended after step {step - 1}") from None
                progress.step()
                with self._saved_on_failure(step):
                    final_eval = self._after_step(step, stop, pipeline, rows, progress) or final_eval
        finally:
            progress.close()
        if final_eval and final_eval["step"] == t.steps:
            self._log_eval(final_eval)
        self._log_done()
        if stop < t.steps and self.rank == 0:  # trainer.stop_after: where and how to go on, last
            where = (f"checkpoint {self.ckpt.step_dir(stop)}; resume with: "
                     f"{resume_command(self.ckpt.path)}"
                     if self.ckpt else "no checkpoint (trainer.checkpoint=false)")
            log.info("stopped after step %d of %d (trainer.stop_after): %s", stop, t.steps, where)
        return rows

    def _after_step(self, step: int, stop: int, pipeline: TorchrecPipeline, rows: list[dict],
                    progress: _Progress) -> dict | None:
        """All ranks, once ``step`` is trained: its metrics row (every ``log_interval`` steps
        and at the last), the decisions, the checkpoint and the evaluation due. The last step
        is saved before its evaluation, so that a failing one loses no training; any other
        after it, so that the checkpoint's history holds the evaluation's row. Returns that
        row (None: no evaluation); raises :class:`TrainingInterrupted` after saving on a
        signal (one during an evaluation stops it: the step is saved, without its row)."""
        t = self.cfg.trainer
        bad = None
        if step % t.log_interval == 0 or step == t.steps:  # not at stop_after: as uninterrupted
            try:
                bad = self._log(step, rows, progress)
            except Exception as e:  # metrics.jsonl unwritable...: the row is in the history
                self.failure = e
        interrupted, due, failed = self._decide(step, bad)
        if failed:  # a rank's data source or log raised: every rank saves this step and stops
            if self.ckpt is not None:
                self._save(step)
            raise self._stop_together()
        last = step == t.steps
        if self.ckpt is not None and last:
            self._save(step)
        evaluate = t.eval and (last or bool(t.eval_interval and step % t.eval_interval == 0))
        row = self._evaluate(step, pipeline, rows) if evaluate else None
        cut = evaluate and row is None
        if cut:  # a signal stopped the evaluation, on every rank
            interrupted = self.signals.signum
        if self.ckpt is not None and (due or interrupted or step == stop):
            self._save(step)  # nothing if saved above
        if row or due:
            self._clock = (time.perf_counter(), step)  # samples/s: training time only
        if interrupted and (step < stop or cut):
            raise TrainingInterrupted(interrupted, step, self.ckpt and self.ckpt.step_dir(step),
                                      self.ckpt and self.ckpt.path)
        return row

    def _watched(self, batches: Iterator) -> Iterator:
        """``batches``, ending where the data source raises, which is kept in ``failure``:
        the pipeline finishes the step it is in (it reads a batch two steps ahead, after the
        backward, before the optimizer step), and :meth:`_after_step` then stops every rank
        after that step, saved. Raised as it is while the pipeline fills (its first
        :data:`FILL` batches): a rank with fewer batches would skip a collective the others
        make, and no step is trained yet."""
        read = 0
        try:
            for batch in batches:
                yield batch
                read += 1
        except Exception as e:
            if read < FILL:
                raise
            self.failure = e

    def _stop_together(self) -> Exception:
        """Every rank, once some rank's data source (:meth:`_watched`) or log failed and the
        step is saved: the exception that ends this rank: its own, or the first failing rank's
        line."""
        self.stopped_together = True
        mine = self.failure
        if self.control is not None:  # every rank joins; at world size 1 the failure is this one
            lines = [None] * self.world
            dist.all_gather_object(lines, mine and _error_line(mine), group=self.control)
        if mine is not None:
            return mine
        rank = next(r for r, line in enumerate(lines) if line)
        return PeerFailed(f"{lines[rank]} (on rank {rank})")

    @contextmanager
    def _saved_on_failure(self, step: int) -> Iterator[None]:
        """The block runs after ``step`` was trained (deciding, saving, evaluating; a failing
        log stops every rank together, :meth:`_stop_together`). At world size 1 an unexpected
        exception in it (``BaseException`` subclasses too) first saves ``step``, unless a save
        raised it, so the run resumes from there. At world size > 1 it saves nothing: one rank
        cannot know that the others will join the save's collectives; the last checkpoint saved
        stays. Errors the user can fix, a non-finite loss among them, and interruptions pass as
        they are."""
        try:
            yield
        except (UsageError, TrainingInterrupted, KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            if self.ckpt is not None and self.world == 1 and step != self.saved and not self.save_failed:
                try:  # RunFailed names the checkpoint
                    self._save(step)
                except BaseException as e:  # (a DCP CheckpointException too) the original goes on
                    log.warning("could not save step %d after the failure: %s", step, e)
            raise

    def _log(self, step: int, rows: list[dict], progress: _Progress) -> torch.Tensor | None:
        """Log the window ending at ``step`` (one host sync) and start the next; returns this
        rank's window losses if one of them is not finite, else None."""
        w = self.window
        stacked = torch.stack(w.losses)
        t0, s0 = self._clock
        steps_per_s = (step - s0) / (time.perf_counter() - t0)
        row = {"step": step, "loss": stacked.mean().item(), "auc": w.auc(),
               "samples_per_s": self.source.spec.batch_size * self.world * steps_per_s,
               "last_loss": w.losses[-1].item()}
        w.clear()
        self._record(row, rows)
        progress.row(row, steps_per_s)
        self._clock = (time.perf_counter(), step)
        return None if torch.isfinite(stacked).all() else stacked

    def _record(self, row: dict, rows: list[dict]) -> None:
        """Rank 0: append ``row`` to this run's rows, the history and metrics.jsonl."""
        if self.rank != 0:
            return
        rows.append(row)
        self.history.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _decide(self, step: int, bad: torch.Tensor | None) -> tuple[int, bool, bool]:
        """``(signal to stop on or 0, checkpoint due, some rank's data source or log failed)``,
        the same on every rank; raises NonFiniteError on every rank if any rank's losses were
        not finite (``bad``: this rank's losses since the last log if one is not)."""
        t = self.cfg.trainer
        due = bool(t.checkpoint_interval and step % t.checkpoint_interval == 0)
        if self.rank == 0 and t.checkpoint_minutes:
            due |= time.monotonic() - self.last_save >= t.checkpoint_minutes * 60
        flags = self._max_over_ranks(
            [self.signals.signum, int(due), int(bad is not None), int(self.failure is not None)])
        if flags[2]:
            self._fail_nonfinite(step, bad)
        return flags[0], bool(flags[1]), bool(flags[3])

    def _max_over_ranks(self, flags: list[int]) -> list[int]:
        """Every rank: each of ``flags``' maximum over the ranks (at world size > 1 one
        all-reduce on the gloo group)."""
        if self.control is None:
            return flags
        x = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.control)
        return x.tolist()

    def _fail_nonfinite(self, step: int, losses: torch.Tensor | None) -> None:
        """Every rank: raise NonFiniteError naming the first step (over ranks) whose loss was not
        finite; ``losses`` are this rank's since the last log (None: all finite)."""
        first = step + 1
        if losses is not None:
            first = step - len(losses) + 1 + int((~torch.isfinite(losses)).nonzero()[0, 0])
        if self.control is not None:
            x = torch.tensor([first])
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control)
            first = int(x)
        raise self._diverged("the loss", first)

    def _diverged(self, what: str, step: int) -> NonFiniteError:
        kept = f"the last checkpoint, step {self.saved}, is kept" if self.saved else "nothing saved"
        return NonFiniteError(f"{what} became non-finite at step {step} (trainer.lr="
                              f"{self.cfg.trainer.lr:g}): training diverged, {kept}; lower "
                              "trainer.lr and train again")

    def _save(self, step: int) -> None:
        """All ranks: checkpoint ``step`` and the metrics window (:meth:`_Window.state`) unless
        saved already, after checking that the window's losses and every weight are finite on
        every rank. A failed save raises its cause in a user's words (:func:`_save_error`); DCP
        raises on every rank, which then stop together."""
        if step == self.saved:
            return
        tensors = [*self.window.losses, *_local_tensors(self.model)]  # one host sync for all:
        ok = torch.stack([torch.isfinite(x).all().to(self.device) for x in tensors]).all()
        ok = ok.to(torch.int64).reshape(1).cpu()
        if self.control is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.control)
        if not int(ok):
            raise self._diverged("the weights or the loss", step)
        window = self.window.state(self.control)
        try:
            self.ckpt.save(step, self.model, self.optimizer, self.history, window)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            self.save_failed = True
            self.stopped_together = isinstance(e, CheckpointException)
            error = _save_error(e, self.ckpt.path)
            if error is e:
                raise
            raise error from e
        self.saved, self.last_save = step, time.monotonic()

    def _evaluate(self, step: int, pipeline: TorchrecPipeline, rows: list[dict]) -> dict | None:
        """All ranks: AUC and log loss over every rank's eval batches, with the model taken off
        the pipeline (its forward is the sharded modules' own), in eval mode, without grad; the
        pipeline's batches in flight stay as they were. Logs a row ``{step, eval_auc,
        eval_logloss}`` and returns it. Before each batch the ranks agree on the signals
        received: after a SIGINT/SIGTERM on any rank every rank returns None, logging nothing,
        with that signal in ``self.signals``."""
        auroc = BinaryAUROC().to(self.device)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # log loss sum, samples
        model = pipeline.detach()
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.source.eval_batches(self.rank, self.world):
                    (signum,) = self._max_over_ranks([self.signals.signum])
                    if signum:
                        self.signals.signum = signum
                        return None
                    _, (_, logits, labels) = model(batch.to(self.device))
                    auroc.update(logits, labels.long())
                    sums[0] += torch.nn.functional.binary_cross_entropy_with_logits(
                        logits.double(), labels.double(), reduction="sum")
                    sums[1] += labels.numel()
        finally:
            model.train()
            pipeline.attach(model, sparse_dist=False)
        if self.world > 1:
            dist.all_reduce(sums)
        row = {"step": step, "eval_auc": auroc.compute().item(), "eval_logloss": (sums[0] / sums[1]).item()}
        self._record(row, rows)
        return row

    def _log_eval(self, row: dict) -> None:
        """Rank 0: the final evaluation, beside the source's baseline if it has one."""
        if self.rank != 0:
            return
        base = self.source.baseline()
        vs = (lambda k: f" (baseline {base[k]:.4f})") if base else (lambda k: "")
        log.info("eval auc %.4f%s, logloss %.4f%s", row["eval_auc"], vs("auc"),
                 row["eval_logloss"], vs("logloss"))

    def _log_done(self) -> None:
        """Rank 0: the run's first and last training rows (a resumed run's first is the
        checkpoint history's)."""
        train_rows = [r for r in self.history if "loss" in r]
        if self.rank == 0 and train_rows:
            first, last = train_rows[0], train_rows[-1]
            log.info("done: loss %.4f -> %.4f, auc %.3f, %.0f samples/s", first["loss"],
                     last["loss"], last["auc"], last["samples_per_s"])


#: a file system with less free space than this is full: a write that failed for space leaves
#: less than a block, and torch.save (DCP's writer) reports it as "unexpected pos", not ENOSPC
FULL_BYTES = 1 << 20


def _save_error(e: BaseException, directory: str) -> BaseException:
    """What a failed save into ``directory`` raises: the error (DCP's CheckpointException holds
    every failing rank's: the first's), an OSError naming its file or else ``directory``
    (Python's writes name none), and ``OSError(ENOSPC)`` naming ``directory`` where its disk is
    full but the error does not say so."""
    e = first_failure(e)
    if isinstance(e, OSError) and e.errno is not None:
        return OSError(e.errno, e.strerror, e.filename or directory)
    if _free_bytes(directory) < FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)
    return e


def _free_bytes(directory: str) -> float:
    """The space free to this user on ``directory``'s file system (inf where unknown)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return float("inf")


def _error_line(e: Exception) -> str:
    """``e`` in one line: a usage error's message, else its type and first line."""
    if isinstance(e, UsageError):
        return str(e)
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _local_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The model's weights held by this rank (a ShardedTensor's local shards)."""
    for value in model.state_dict().values():
        if isinstance(value, ShardedTensor):
            yield from (shard.tensor for shard in value.local_shards())
        elif isinstance(value, torch.Tensor):
            yield value

