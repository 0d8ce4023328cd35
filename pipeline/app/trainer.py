"""The training job behind ``scripts/train.py``: one loop for 1 CPU process or N GPUs.

Rank 0 alone prints (a progress bar with loss and samples/s) and writes (``metrics.jsonl``,
``config.yaml``); checkpoints go through torch.distributed.checkpoint (DCP) from every rank into
one directory that rank 0 chooses and broadcasts. Batch ``s`` of rank ``r`` is a function of
(data seed, r, s) only, so a run resumed at step k sees the batches an uninterrupted run sees.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from itertools import count

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from tqdm import tqdm

from recpipe.pipeline.data_parallel import BucketedAllReduce
from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist as RecpipePipeline
from recpipe.pipeline.synthetic import (
    Batch,
    ModelSpec,
    build_sharded,
    make_batch,
    deterministic_kernels,
)
from recpipe.pipeline.app.config import TrainConfig

PIPELINES = {"torchrec": TorchrecPipeline, "recpipe": RecpipePipeline}


def model_spec(cfg: TrainConfig) -> ModelSpec:
    m, d = cfg.model, cfg.data
    if d.schema == "criteo":  # 13 dense + 26 sparse features, one EmbeddingBagCollection
        return ModelSpec(num_tables=26, rows=m.rows, dim=m.dim, dense_in=13,
                         batch_size=d.batch_size, pooling=d.pooling, zipf=d.zipf,
                         weighted=False, sequence=False)
    return ModelSpec(num_tables=m.num_tables, rows=m.rows, dim=m.dim, dense_in=d.dense_in,
                     batch_size=d.batch_size, pooling=d.pooling, zipf=d.zipf,
                     weighted=m.weighted, sequence=m.sequence)


def batch_stream(
    spec: ModelSpec, data_seed: int, rank: int, start: int, stop: int
) -> Iterator[Batch]:
    """Batches ``start .. stop-1`` of ``rank``."""
    for step in range(start, stop):
        yield make_batch(spec, seed=(data_seed * 1_000_003 + rank) * 1_000_003 + step)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "fused_optimizer": model.fused_optimizer.state_dict()}


def save_checkpoint(
    path: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """All ranks: DCP save of model, dense and fused optimizer state, and the step."""
    state = _state(model, optimizer)
    state["step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=os.path.join(path, f"step_{step}"))
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(str(step))
    dist.barrier()


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """All ranks: load the latest checkpoint under ``path`` in place; returns its step."""
    with open(os.path.join(path, "latest")) as f:
        step = int(f.read())
    state = _state(model, optimizer)
    state["step"] = torch.tensor(0)
    dcp.load(state, checkpoint_id=os.path.join(path, f"step_{step}"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    model.fused_optimizer.load_state_dict(state["fused_optimizer"])
    return int(state["step"])


def run_dir(cfg: TrainConfig) -> str:
    """Rank 0 makes ``<output_dir>/<timestamp>-<pipeline>`` and tells the other ranks."""
    path = [None]
    if dist.get_rank() == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in count():
            path[0] = os.path.join(cfg.output_dir, f"{stamp}-{cfg.pipeline.name}" + (f"-{i}" if i else ""))
            if not os.path.exists(path[0]):
                break
        os.makedirs(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def train(cfg: TrainConfig, device: torch.device, out_dir: str) -> list[dict]:
    """Train ``cfg.trainer.steps`` steps (from the checkpoint if ``resume``); returns rank 0's
    logged metrics (also in ``out_dir/metrics.jsonl``)."""
    with deterministic_kernels(cfg.trainer.deterministic):
        return _train(cfg, device, out_dir)


def _train(cfg: TrainConfig, device: torch.device, out_dir: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = cfg.trainer
    spec = model_spec(cfg)
    allreduce = cfg.pipeline.dense_allreduce
    if allreduce == "auto":
        allreduce = "symm_mem" if device.type == "cuda" and world > 1 else "nccl"
    model, optimizer = build_sharded(
        spec, list(cfg.sharding.types), device, dist.group.WORLD, lr=t.lr, seed=t.seed,
        optimizer=t.optimizer,
        data_parallel=None if allreduce == "ddp" else BucketedAllReduce(
            compile=True, symm_mem=allreduce == "symm_mem"
        ),
    )
    ckpt = t.checkpoint_dir or os.path.join(out_dir, "checkpoint")
    start = load_checkpoint(ckpt, model, optimizer) if t.resume else 0
    if t.checkpoint:
        os.makedirs(ckpt, exist_ok=True)
    stop = min(t.steps, t.stop_after) if t.stop_after is not None else t.steps
    pipeline = PIPELINES[cfg.pipeline.name](model, optimizer, device)
    it = batch_stream(spec, cfg.data.seed, rank, start, stop)
    auroc = BinaryAUROC().to(device)
    metrics, losses = [], []
    bar = tqdm(total=t.steps, initial=start, disable=rank != 0, desc=cfg.pipeline.name, unit="step")
    t0, s0 = time.perf_counter(), start
    for step in range(start, stop):
        loss, logits, labels = pipeline.progress(it)
        auroc.update(logits, labels.long())
        losses.append(loss)
        if (step + 1) % t.log_interval == 0 or step + 1 == stop:
            mean_loss = torch.stack(losses).mean().item()  # one sync per interval
            elapsed = time.perf_counter() - t0
            row = dict(step=step + 1, loss=mean_loss, auc=auroc.compute().item(),
                       samples_per_s=spec.batch_size * world * (step + 1 - s0) / elapsed,
                       last_loss=losses[-1].item())
            auroc.reset()
            losses.clear()
            t0, s0 = time.perf_counter(), step + 1
            if rank == 0:
                metrics.append(row)
                with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{row['samples_per_s']:.0f}")
        bar.update(1)
        if t.checkpoint and t.checkpoint_interval and (step + 1) % t.checkpoint_interval == 0:
            save_checkpoint(ckpt, step + 1, model, optimizer)
    bar.close()
    if t.checkpoint and (not t.checkpoint_interval or stop % t.checkpoint_interval):
        save_checkpoint(ckpt, stop, model, optimizer)
    return metrics
