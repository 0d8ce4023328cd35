"""recpipe in your own torchrec job: swap one import.

A job written against torchrec's ``TrainPipelineSparseDist`` keeps its model, optimizer, batches
and loop; only the import changes:

    # from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from recpipe.pipeline import TrainPipelineSparseDist

Runnable as is, on CPU, in one process (gloo, world size 1), with recpipe's small synthetic
DLRM-style model; ``--pipeline torchrec`` runs the same job with torchrec's class (the losses are
identical):

    .venv/bin/python examples/swap_pipeline.py                      # recpipe's pipeline
    .venv/bin/python examples/swap_pipeline.py --pipeline torchrec  # torchrec's, for comparison

Under ``torchrun`` it uses the environment torchrun sets (RANK, WORLD_SIZE, MASTER_PORT...).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from recpipe.testing.synthetic import ModelSpec, batches, build_sharded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", choices=["recpipe", "torchrec"], default="recpipe")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    if "RANK" not in os.environ:  # plain `python examples/swap_pipeline.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo")
    device = torch.device("cpu")

    if args.pipeline == "torchrec":
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    else:
        from recpipe.pipeline import TrainPipelineSparseDist  # the one-line swap

    # --- the job, unchanged whichever class was imported ---
    spec = ModelSpec()  # 4 tables per sparse module (EBC, weighted EBC, EC), batch 32
    model, optimizer = build_sharded(spec, ["table_wise", "column_wise"], device, dist.group.WORLD)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, args.steps, rank=dist.get_rank())
    for step in range(args.steps):
        loss, _logits, _labels = pipeline.progress(it)
        print(f"step {step} loss {loss.item()!r}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
