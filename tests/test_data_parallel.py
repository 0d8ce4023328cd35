"""BucketedAllReduce (dense grads without DDP) against torchrec's default DDP, on 2 ranks (gloo on
CPU; NCCL, and symmetric memory, on 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

from recpipe.pipeline import TrainPipelineSparseDist
from recpipe.pipeline.data_parallel import BucketedAllReduce, _buckets
from recpipe.pipeline.synthetic import ModelSpec, batches, build_sharded

STEPS = 100


def _train(rank: int, world: int, device: torch.device, variant: str) -> list[float]:
    wrapper = {
        "ddp": None,
        "bucketed": BucketedAllReduce(bucket_cap_mb=0.01),  # several buckets
        "bucketed_compiled": BucketedAllReduce(bucket_cap_mb=0.01, compile=True),
        "symm_mem": BucketedAllReduce(bucket_cap_mb=0.01, symm_mem=True),
    }[variant]
    spec = ModelSpec()
    model, optimizer = build_sharded(
        spec, ["table_wise", "column_wise"], device, torch.distributed.group.WORLD, seed=1,
        data_parallel=wrapper,
    )
    if wrapper is not None:
        assert len(wrapper.buckets) > 2
        # Fewer graphs than buckets allowed per function by default: the wrapper must cope.
        torch._dynamo.config.recompile_limit = 2
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, STEPS, rank, seed=3)
    losses = [pipeline.progress(it)[0].item() for _ in range(STEPS)]
    if variant in ("bucketed_compiled", "symm_mem"):  # every bucket ran compiled: one graph each
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(wrapper.buckets)
    return losses


GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("variant", ["bucketed", "bucketed_compiled"] + (["symm_mem"] if GPU2 else []))
def test_losses_match_ddp(variant: str) -> None:
    ddp = run_ranks(2, _train, "ddp")
    ours = run_ranks(2, _train, variant)
    for a, b in zip(ddp, ours):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)


def test_buckets_split_by_size_and_dtype() -> None:
    ps = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
          [(10, torch.float32), (10, torch.float32), (300, torch.float32), (4, torch.float64)]]
    groups = _buckets(ps, cap_bytes=1000)
    assert [[p.numel() for p in g] for g in groups] == [[4], [300], [10, 10]]


def test_unused_parameter_is_an_error() -> None:
    lin, unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    wrapper = BucketedAllReduce()
    wrapper.buckets = []
    from recpipe.pipeline.data_parallel import _Bucket

    wrapper.buckets = [
        _Bucket(list(lin.parameters()) + list(unused.parameters()), wrapper, lambda grads, group: grads)
    ]
    with pytest.raises(RuntimeError, match="got no gradient"):
        lin(torch.ones(2, 3)).sum().backward()


def _symm_mem_on_cpu(rank: int, world: int, device: torch.device) -> str:
    spec = ModelSpec(weighted=False, sequence=False)
    try:
        build_sharded(spec, ["table_wise"], device, torch.distributed.group.WORLD,
                      data_parallel=BucketedAllReduce(symm_mem=True))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_symm_mem_needs_cuda_and_nccl() -> None:
    assert run_ranks(1, _symm_mem_on_cpu) == ["BucketedAllReduce(symm_mem=True) needs CUDA and an NCCL group"]
