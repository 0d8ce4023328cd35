"""BucketedAllReduce (dense grads without DDP) against torchrec's default DDP, on 2 ranks (gloo on
CPU; NCCL, and symmetric memory, on 2 GPUs); on one rank in the test's process: no recompiles,
the bucket plan, and what needs CUDA or one node."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from group_fixtures import local_group_fixture, symmetric_h200_fixture  # noqa: F401 (fixtures)
from torch import nn
from torch._dynamo.utils import counters
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.pipeline import TrainPipelineSparseDist
from recpipe.pipeline.data_parallel import BucketedAllReduce, _Bucket, _buckets, mean_all_reduce
from recpipe.testing.synthetic import ModelSpec, batches, build_sharded

GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2
STEPS = 100 if GPU2 else 40  # the GPU check's 100; fewer on 2 CPU cores


def _train(rank: int, world: int, device: torch.device, variant: str) -> tuple[list[float], list[str]]:
    """The losses of ``STEPS`` steps with ``variant``'s dense all-reduce, and its plan's
    algorithms per bucket."""
    wrapper = {
        "ddp": None,
        "bucketed": BucketedAllReduce(bucket_cap_mb=2e-4),  # 209 bytes: 4 buckets
        "bucketed_compiled": BucketedAllReduce(bucket_cap_mb=2e-4, compile=True),
        "symm_mem": BucketedAllReduce(bucket_cap_mb=2e-4, algorithm="symm_mem"),
        "auto": BucketedAllReduce(bucket_cap_mb=2e-4, algorithm="auto"),  # on CPU: gloo
        "auto_across_nodes": BucketedAllReduce(bucket_cap_mb=2e-4, algorithm="auto", node_local=False),
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
    counters.clear()
    torch._dynamo.reset()  # no graph of an earlier variant: identical guards would reuse it
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, STEPS, rank, seed=3)
    losses = [pipeline.progress(it)[0].item() for _ in range(STEPS)]
    if wrapper is not None:  # one graph per compiled bucket: all with compile=True, else those
        # that go through symmetric memory (the NCCL ones run eagerly)
        plan = [a for _, a in wrapper.plan()]
        compiled = len(plan) if variant == "bucketed_compiled" else sum(a != "nccl" for a in plan)
        assert counters["stats"]["unique_graphs"] == compiled, (variant, plan)
    return losses, [] if wrapper is None else [a for _, a in wrapper.plan()]


VARIANTS = ["bucketed", "bucketed_compiled", "auto", "auto_across_nodes"] + (["symm_mem"] if GPU2 else [])


def _train_all(rank: int, world: int, device: torch.device) -> dict[str, tuple[list[float], list[str]]]:
    return {v: _train(rank, world, device, v) for v in ["ddp", *VARIANTS]}


def test_losses_match_ddp_and_auto_falls_back_to_nccl() -> None:
    """Every variant's losses are DDP's (rtol 1e-5); ``auto`` reduces through NCCL (gloo) on
    CPU and across nodes."""
    for runs in run_ranks(2, _train_all):  # every variant in the same 2 processes
        ddp, _ = runs["ddp"]
        for variant in VARIANTS:
            losses, plan = runs[variant]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp), rtol=1e-5, atol=0,
                                       msg=variant)
            if variant.startswith("auto") and (not torch.cuda.is_available() or variant != "auto"):
                assert set(plan) == {"nccl"}, (variant, plan)


def test_buckets_split_by_size_and_dtype() -> None:
    ps = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
          [(10, torch.float32), (10, torch.float32), (300, torch.float32), (4, torch.float64),
           (4, torch.float64)]]
    groups = _buckets(ps, cap_bytes=lambda dtype: 1000 if dtype == torch.float32 else 40)
    assert [[p.numel() for p in g] for g in groups] == [[4], [4], [300], [10, 10]]
    # a tensor larger than the cap closes the bucket being filled, with the tensors before it;
    # one of exactly the cap does not
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 10, 10, 300, 10, 250, 10)]
    groups = _buckets(ps, cap_bytes=lambda dtype: 1000)
    assert [[p.numel() for p in g] for g in groups] == [[10], [250], [10, 300], [10, 10, 300]]


def test_unused_parameter_is_an_error() -> None:
    lin, unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    wrapper = BucketedAllReduce()
    wrapper.buckets = [
        _Bucket(list(lin.parameters()) + list(unused.parameters()), wrapper, "nccl", lambda grads, group, a: grads)
    ]
    with pytest.raises(RuntimeError, match="got no gradient"):
        lin(torch.ones(2, 3)).sum().backward()


STEPS_ONE_RANK = 8


def test_compiled_buckets_never_recompile(local_group: dist.ProcessGroup) -> None:
    """Training compiles one graph per bucket in its first step, then none: a recompile after
    step 3 fails. A bucket of a new shape does add a graph (the count would see one)."""
    torch._dynamo.reset()  # no graph of an earlier test in this process
    spec = ModelSpec(weighted=False, sequence=False)
    wrapper = BucketedAllReduce(bucket_cap_mb=2e-4, compile=True)  # 209 bytes: 4 buckets
    device = torch.device("cpu")
    model, optimizer = build_sharded(spec, ["table_wise"], device, local_group, data_parallel=wrapper)
    assert len(wrapper.buckets) > 1 and wrapper.plan() == [(b.nbytes, "nccl") for b in wrapper.buckets]
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, STEPS_ONE_RANK, 0, seed=3)
    before = counters["stats"]["unique_graphs"]
    graphs = []
    for _ in range(STEPS_ONE_RANK):
        pipeline.progress(it)
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[2:] == [len(wrapper.buckets)] * (STEPS_ONE_RANK - 2), graphs
    wrapper.buckets[0].reduce([torch.ones(3)], local_group, "nccl")
    assert counters["stats"]["unique_graphs"] - before == len(wrapper.buckets) + 1


def _dense_dmp(wrapper: BucketedAllReduce, group: dist.ProcessGroup) -> DistributedModelParallel:
    """20 MiB of fp32 Linear layers after a tiny fp64 one, data-parallel through ``wrapper``."""
    model = nn.Sequential(nn.Linear(4, 4).double(), *[nn.Linear(1024, 1024) for _ in range(5)])
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(group),
                                    device=torch.device("cpu"), data_parallel_wrapper=wrapper)


@pytest.mark.usefixtures("symmetric_h200")
def test_plan_caps_buckets_where_symmetric_memory_wins(local_group: dist.ProcessGroup) -> None:
    """On the shipped 2 x H200 table (fp32 measured, 200 calls per size), auto caps fp32 buckets at
    16 MiB, the largest size where two-shot's interval shows a win; NCCL keeps 25 MiB."""
    K, M = 1 << 10, 1 << 20
    fp64 = (4 * 4 + 4) * 8
    expected = {
        "nccl": [(20 * M + 20 * K, "nccl"), (fp64, "nccl")],
        "auto": [(12 * M + 16 * K, "two_shot"), (8 * M + 4 * K, "two_shot"), (fp64, "nccl")],
        "symm_mem": [(12 * M + 16 * K, "two_shot"), (8 * M + 4 * K, "two_shot"), (fp64, "nccl")],
    }
    for algorithm, plan in expected.items():
        wrapper = BucketedAllReduce(algorithm=algorithm)
        wrapper._enable_symmetric_memory = lambda group, device: algorithm != "nccl"  # as on GPUs
        _dense_dmp(wrapper, local_group)
        assert wrapper.plan() == plan, algorithm
        # only the symmetric buckets are compiled; the NCCL ones run the plain reduction
        assert [b.reduce is mean_all_reduce for b in wrapper.buckets] == [a == "nccl" for _, a in plan]


def test_symm_mem_needs_cuda_and_nccl(local_group: dist.ProcessGroup) -> None:
    message = r"^BucketedAllReduce\(algorithm='symm_mem'\) needs CUDA and an NCCL group$"
    with pytest.raises(ValueError, match=message):
        _dense_dmp(BucketedAllReduce(algorithm="symm_mem"), local_group)


def test_a_group_across_nodes_goes_through_nccl(
    local_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture,
) -> None:
    """``node_local=False``: symmetric memory is not even tried (which would need CUDA here)."""
    wrapper = BucketedAllReduce(algorithm="symm_mem", node_local=False)
    with caplog.at_level(logging.INFO, logger="recpipe.pipeline.data_parallel"):
        _dense_dmp(wrapper, local_group)
    assert [r.getMessage() for r in caplog.records if r.name == "recpipe.pipeline.data_parallel"] == [
        "BucketedAllReduce(algorithm='symm_mem'): the process group spans nodes, so every bucket "
        "goes through NCCL"]
    assert {a for _, a in wrapper.plan()} == {"nccl"}


def test_unknown_algorithm_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        BucketedAllReduce(algorithm="one_shot")
