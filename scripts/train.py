"""Train the synthetic DLRM-style model with torchrec's or recpipe's pipeline (Hydra config).

    python scripts/train.py                                    # 1 CPU process (gloo), ~15 s
    python scripts/train.py pipeline=torchrec trainer.steps=100
    torchrun --nproc-per-node=2 scripts/train.py hardware=cuda
    python scripts/train.py -m pipeline=torchrec,recpipe       # a sweep (Hydra multirun)

Configs: configs/ (groups model, data, sharding, pipeline, hardware, trainer); the schema and
value checks: recpipe.pipeline.app.config. Output (rank 0): <output_dir>/<time>-<pipeline>/
with config.yaml, metrics.jsonl and checkpoint/.
"""

from __future__ import annotations

import os

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from recpipe.pipeline.app.config import register, validate
from recpipe.pipeline.app.trainer import run_dir, train

register()


def _init_distributed(backend: str) -> torch.device:
    if "RANK" not in os.environ:  # plain `python scripts/train.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(dcfg)
    try:
        validate(cfg)
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from None
    device = _init_distributed(cfg.hardware.backend)
    out = run_dir(cfg)
    if dist.get_rank() == 0:
        OmegaConf.save(dcfg, os.path.join(out, "config.yaml"))
        print(f"run dir: {out}  (world size {dist.get_world_size()}, {device})", flush=True)
    metrics = train(cfg, device, out)
    if dist.get_rank() == 0 and metrics:
        first, last = metrics[0], metrics[-1]
        print(f"done: loss {first['loss']:.4f} -> {last['loss']:.4f}, auc {last['auc']:.3f}, "
              f"{last['samples_per_s']:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
