"""The training job behind ``scripts/train.py``: one loop for 1 CPU process or N GPUs.

Rank 0 alone logs (a progress bar with loss and samples/s, ``logging`` for the rest) and writes
``metrics.jsonl`` and ``config.yaml``; checkpoints go through :mod:`.checkpoint` (DCP, every
rank, one directory). Batch ``s`` of rank ``r`` is a function of (data seed, r, s) only
(:mod:`.data`), so a run resumed at step k reaches the losses of an uninterrupted run, bit for
bit. Evaluation (``trainer.eval_interval`` and at the end) runs the source's held-out batches
through the model taken off the pipeline (``detach``/``attach``): the training losses are the
same with and without it.

Every rank takes the same decisions at the same step: at world size > 1 one all-reduce of three
flags per step on a gloo group (a SIGINT/SIGTERM on any rank, a checkpoint due on rank 0's clock,
a non-finite loss at a log step), so that all ranks stop, save or fail together.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from itertools import count

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from tqdm import tqdm

from recpipe.train.checkpoint import CheckpointDir
from recpipe.train.config import TrainConfig, UsageError, save_yaml
from recpipe.train.data import DataSource, make_source
from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist as RecpipePipeline
from recpipe.testing.synthetic import build_sharded, deterministic_kernels
from recpipe.pipeline.topology import group_is_node_local, node_layout, planner_topology

PIPELINES = {"torchrec": TorchrecPipeline, "recpipe": RecpipePipeline}

log = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run after step ``step``, saved in ``checkpoint`` (a step
    directory; None when ``trainer.checkpoint=false``). Raised on every rank."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, checkpoint_dir: str | None):
        super().__init__(f"{signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step
        self.checkpoint, self.checkpoint_dir = checkpoint, checkpoint_dir


class NonFiniteError(UsageError):
    """The loss or the weights became NaN/inf; nothing of that state was checkpointed."""


def make_run_dir(cfg: TrainConfig) -> str:
    """Rank 0 makes ``<output_dir>/<timestamp>-<pipeline>[-i]`` and tells the other ranks."""
    path = [None]
    if dist.get_rank() == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in count():
            path[0] = os.path.join(cfg.output_dir, f"{stamp}-{cfg.pipeline.name}" + (f"-{i}" if i else ""))
            try:
                os.makedirs(path[0])
                break
            except FileExistsError:  # another run took it
                continue
    dist.broadcast_object_list(path, src=0)
    return path[0]


def train(cfg: TrainConfig, device: torch.device, out_dir: str | None = None) -> list[dict]:
    """Train to ``cfg.trainer.steps`` (from the checkpoint if ``resume``); all ranks.

    The checkpoint directory is locked and checked, the model built and the checkpoint loaded
    first; only then is ``out_dir`` (default: a new run directory, :func:`make_run_dir`)
    written: ``config.yaml`` and ``metrics.jsonl`` (a resumed run's starts with the
    checkpoint's rows, so it holds the whole history once). Returns the rows this run logged
    (rank 0; empty elsewhere). Raises, on every rank, :class:`~.config.UsageError` (a refused
    checkpoint directory, a non-finite loss) and :class:`TrainingInterrupted` after a
    SIGINT/SIGTERM (the step finished and saved)."""
    t = cfg.trainer
    with ExitStack() as stack:
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
        return trainer.run(out, ckpt if t.checkpoint else None)


class _Signals:
    """The first SIGINT/SIGTERM received (0: none)."""

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


class _Trainer:
    """One run: the model, its pipeline, metrics and checkpoints (see :func:`train`)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, signals: _Signals,
                 ckpt: CheckpointDir | None) -> None:
        """Build the model; load ``ckpt.resume`` if there is one."""
        self.cfg, self.device, self.signals = cfg, device, signals
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = node_layout(self.world)
        t = cfg.trainer
        self.source: DataSource = make_source(cfg)
        allreduce = cfg.pipeline.dense_allreduce
        data_parallel = None  # torchrec's DDP
        if allreduce != "ddp":  # imported here: it loads inductor (2 s), for these runs only
            from recpipe.pipeline.data_parallel import BucketedAllReduce

            node_local = group_is_node_local(self.layout, dist.group.WORLD)
            data_parallel = BucketedAllReduce(compile=True, algorithm=allreduce, node_local=node_local)
        hw = cfg.hardware
        topology = planner_topology(self.layout, device, hw.intra_node_gb_s, hw.inter_node_gb_s)
        self.model, self.optimizer = build_sharded(
            self.source.spec, list(cfg.sharding.types), device, dist.group.WORLD, lr=t.lr,
            seed=t.seed, optimizer=t.optimizer, data_parallel=data_parallel, topology=topology,
        )
        if data_parallel is not None and self.rank == 0:
            log.info("dense all-reduce %s, buckets (bytes, algorithm): %s", allreduce,
                     data_parallel.plan())
        resume = ckpt.resume if ckpt else None
        self.start = self.saved = resume.step if resume else 0
        if resume:
            ckpt.load(self.model, self.optimizer)
            log.info("resumed from %s", resume.path)
        #: rank 0: every metrics row of the run so far (a resumed run: the checkpoint's first)
        self.history = resume.history() if resume and self.rank == 0 else []
        self.control = dist.new_group(backend="gloo") if self.world > 1 else None

    def run(self, out: str, ckpt: CheckpointDir | None) -> list[dict]:
        """Train, logging into ``out/metrics.jsonl`` and checkpointing into ``ckpt``."""
        t = self.cfg.trainer
        self.ckpt, self.last_save = ckpt, time.monotonic()
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        if self.rank == 0:
            with open(self.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.history)
        stop = min(t.steps, t.stop_after or t.steps)
        pipeline = PIPELINES[self.cfg.pipeline.name](self.model, self.optimizer, self.device)
        it = self.source.train_batches(self.rank, self.world, self.start, stop)
        auroc = BinaryAUROC().to(self.device)
        rows, losses, final_eval = [], [], None
        bar = tqdm(total=t.steps, initial=self.start, disable=None if self.rank == 0 else True,
                   desc=self.cfg.pipeline.name, unit="step")  # None: off when not a terminal
        self._clock = (time.perf_counter(), self.start)
        try:
            for step in range(self.start + 1, stop + 1):  # step: steps done after this one
                loss, logits, labels = pipeline.progress(it)
                auroc.update(logits, labels.long())
                losses.append(loss)
                bar.update(1)
                bad = None
                if step % t.log_interval == 0 or step == stop:
                    bad = self._log(step, losses, auroc, rows, bar)
                interrupted, due = self._decide(step, bad)
                evaluate = t.eval and (step == t.steps or (t.eval_interval and step % t.eval_interval == 0))
                if evaluate:
                    final_eval = self._evaluate(step, pipeline, rows)
                if self.ckpt and (due or interrupted or step == stop):
                    self._save(step, losses)
                if evaluate or due:
                    self._clock = (time.perf_counter(), step)  # samples/s: training time only
                if interrupted and step < stop:
                    raise TrainingInterrupted(
                        interrupted, step, self.ckpt and self.ckpt.step_dir(step),
                        self.ckpt and self.ckpt.path)
        finally:
            bar.close()
        if stop < t.steps and self.rank == 0:  # trainer.stop_after: say where and how to go on
            where = (f"checkpoint {self.ckpt.step_dir(stop)}; resume with the same command and "
                     f"trainer.resume=true trainer.checkpoint_dir={self.ckpt.path}"
                     if self.ckpt else "no checkpoint (trainer.checkpoint=false)")
            log.info("stopped after step %d of %d (trainer.stop_after): %s", stop, t.steps, where)
        if final_eval and final_eval["step"] == t.steps:
            self._log_eval(final_eval)
        return rows

    def _log(self, step: int, losses: list[torch.Tensor], auroc: BinaryAUROC, rows: list[dict],
             bar: tqdm) -> torch.Tensor | None:
        """Log the interval ending at ``step`` (one host sync) and start the next; returns this
        rank's interval losses if one of them is not finite, else None."""
        stacked = torch.stack(losses)
        t0, s0 = self._clock
        row = {"step": step, "loss": stacked.mean().item(), "auc": auroc.compute().item(),
               "samples_per_s": self.source.spec.batch_size * self.world * (step - s0)
               / (time.perf_counter() - t0),
               "last_loss": losses[-1].item()}
        self._record(row, rows)
        bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.0f}")
        auroc.reset()
        losses.clear()
        self._clock = (time.perf_counter(), step)
        return None if torch.isfinite(stacked).all() else stacked

    def _record(self, row: dict, rows: list[dict]) -> None:
        """Rank 0: append ``row`` to metrics.jsonl, this run's rows and the history."""
        if self.rank != 0:
            return
        rows.append(row)
        self.history.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _decide(self, step: int, bad: torch.Tensor | None) -> tuple[int, bool]:
        """``(signal to stop on or 0, checkpoint due)``, the same on every rank; raises
        NonFiniteError on every rank if any rank's losses were not finite (``bad``: this
        rank's losses since the last log if one is not)."""
        t = self.cfg.trainer
        due = bool(t.checkpoint_interval and step % t.checkpoint_interval == 0)
        if self.rank == 0 and t.checkpoint_minutes:
            due |= time.monotonic() - self.last_save >= t.checkpoint_minutes * 60
        flags = [self.signals.signum, int(due), int(bad is not None)]
        if self.control is not None:
            x = torch.tensor(flags, dtype=torch.int64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.control)
            flags = x.tolist()
        if flags[2]:
            self._fail_nonfinite(step, bad)
        return flags[0], bool(flags[1])

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

    def _save(self, step: int, pending: list[torch.Tensor]) -> None:
        """All ranks: checkpoint ``step`` unless saved already, after checking that the losses
        not yet logged and every weight are finite on every rank."""
        if step == self.saved:
            return
        finite = all(bool(torch.isfinite(x).all()) for x in [*pending, *_local_tensors(self.model)])
        ok = torch.tensor([int(finite)])
        if self.control is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.control)
        if not int(ok):
            raise self._diverged("the weights or the loss", step)
        self.ckpt.save(step, self.model, self.optimizer, self.history)
        self.saved, self.last_save = step, time.monotonic()

    def _evaluate(self, step: int, pipeline: TorchrecPipeline, rows: list[dict]) -> dict:
        """All ranks: AUC and log loss over every rank's eval batches, with the model taken off
        the pipeline (its forward is the sharded modules' own), in eval mode, without grad; the
        pipeline's batches in flight stay as they were. Logs a row ``{step, eval_auc,
        eval_logloss}`` and returns it."""
        auroc = BinaryAUROC().to(self.device)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # log loss sum, samples
        model = pipeline.detach()
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.source.eval_batches(self.rank, self.world):
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


def _local_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The model's weights held by this rank (a ShardedTensor's local shards)."""
    for value in model.state_dict().values():
        if isinstance(value, ShardedTensor):
            yield from (shard.tensor for shard in value.local_shards())
        elif isinstance(value, torch.Tensor):
            yield value

