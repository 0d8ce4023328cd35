"""BucketedAllReduce (torchrec's DDP wrapper with a symmetric-memory communication hook) against
torchrec's default DDP, on 2 ranks (gloo on CPU; NCCL, and symmetric memory, on 2 GPUs); on one
rank in the test's process: the bucket cap, the hook's streams, and what needs CUDA or one node.

On CPU, the hook's symmetric branch runs with the bucket sizes' choice forced (``_forced``): its
reduction then goes through gloo, and the optimizer must still read every bucket's mean."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from group_fixtures import local_group_fixture, symmetric_h200_fixture  # noqa: F401 (fixtures)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.pipeline import TrainPipelineSparseDist
from recpipe.pipeline import data_parallel
from recpipe.pipeline.data_parallel import BucketedAllReduce, SymmetricHook, symmetric_hook
from recpipe.testing.synthetic import ModelSpec, batches, build_sharded

GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2
STEPS = 100 if GPU2 else 40  # the GPU check's 100; fewer on 2 CPU cores
CAP_MB = 2e-4  # 209 bytes: several buckets of the small model's dense part


def _forced(wrapper: BucketedAllReduce, skip_mean: bool = False) -> BucketedAllReduce:
    """``wrapper`` with its hook on CPU (as if symmetric memory could run), every other bucket
    size sent through the hook's symmetric branch (gloo underneath); ``skip_mean``: that branch
    leaves the rank's own grads (the control: the optimizer must then see different losses)."""
    wrapper._enable_symmetric_memory = lambda group, device: True  # type: ignore[method-assign]
    data_parallel.choose_algorithm = lambda nbytes, *args: "two_shot" if nbytes % 8 else "nccl"
    if skip_mean:
        data_parallel.mean_all_reduce = lambda grads, group, algorithm: grads
    return wrapper


_MEAN = data_parallel.mean_all_reduce
_SPIN_CYCLES = 40_000_000  # far longer than the host's step


def _lagging(wrapper: BucketedAllReduce) -> BucketedAllReduce:
    """GPUs: each symmetric reduction queued behind a long spin kernel on the communication
    stream, so that an optimizer not made to wait for it would read the rank's own grads."""
    def slow(grads: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str) -> list[torch.Tensor]:
        torch.cuda._sleep(_SPIN_CYCLES)
        return _MEAN(grads, group, algorithm)

    data_parallel.mean_all_reduce = slow
    return wrapper


def _train(rank: int, world: int, device: torch.device, variant: str) -> tuple[list[float], list[str]]:
    """The losses of ``STEPS`` steps with ``variant``'s dense all-reduce, and what each bucket
    ran in the last step."""
    wrapper = {
        "ddp": lambda: None,
        "nccl": lambda: BucketedAllReduce(bucket_cap_mb=CAP_MB),
        "auto": lambda: BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto"),  # CPU: DDP's
        "auto_across_nodes": lambda: BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto",
                                                       node_local=False),
        "symm_mem": lambda: BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="symm_mem"),
        "symm_mem_lagging": lambda: _lagging(BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="symm_mem")),
        "forced": lambda: _forced(BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto")),
        "forced_no_mean": lambda: _forced(BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto"),
                                          skip_mean=True),
    }[variant]()
    spec = ModelSpec()
    model, optimizer = build_sharded(
        spec, ["table_wise", "column_wise"], device, torch.distributed.group.WORLD, seed=1,
        data_parallel=wrapper,
    )
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, STEPS, rank, seed=3)
    losses = [pipeline.progress(it)[0].item() for _ in range(STEPS)]
    return losses, [] if wrapper is None else [a for _, a in wrapper.plan()]


def _train_all(rank: int, world: int, device: torch.device, variants: list[str]) -> dict:
    return {v: _train(rank, world, device, v) for v in ["ddp", *variants]}


GPU_VARIANTS = ["symm_mem", "symm_mem_lagging"] if GPU2 else []  # (the last patches the module)
CPU_VARIANTS = [] if GPU2 else ["forced", "forced_no_mean"]  # (they patch the module)


def test_losses_match_ddp_and_auto_falls_back_to_ddp() -> None:
    """Every variant's losses are DDP's (rtol 1e-5): the optimizer reads each bucket's mean,
    also where the hook's symmetric branch reduced it (CPU: ``forced``, and the control without
    the mean differs; GPUs: ``symm_mem``, and behind a spin kernel); ``auto`` on CPU and across
    nodes is DDP's own all-reduce (no hook)."""
    variants = ["nccl", "auto", "auto_across_nodes", *GPU_VARIANTS, *CPU_VARIANTS]
    for runs in run_ranks(2, _train_all, variants):  # every variant in the same 2 processes
        ddp, _ = runs["ddp"]
        for variant in variants:
            losses, plan = runs[variant]
            if variant == "forced_no_mean":
                assert losses != ddp
                continue
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp), rtol=1e-5, atol=0,
                                       msg=variant)
            if variant == "forced":
                assert set(plan) == {"two_shot", "nccl"}, plan
            elif not variant.startswith("symm_mem") and (not torch.cuda.is_available() or variant != "auto"):
                assert plan == [], (variant, plan)


def _dense_dmp(wrapper: BucketedAllReduce, group: dist.ProcessGroup) -> DistributedModelParallel:
    """20 MiB of fp32 Linear layers after a tiny fp64 one, data-parallel through ``wrapper``."""
    model = nn.Sequential(nn.Linear(4, 4).double(), *[nn.Linear(1024, 1024) for _ in range(5)])
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(group),
                                    device=torch.device("cpu"), data_parallel_wrapper=wrapper)


@pytest.mark.usefixtures("symmetric_h200")
def test_cap_is_the_largest_bucket_symmetric_memory_wins_at(local_group: dist.ProcessGroup) -> None:
    """On the shipped 2 x H200 table (fp32 measured, 200 calls per size), ``auto`` caps DDP's
    buckets at 16 MiB, the largest size where two-shot's interval shows a win, and registers
    its hook; ``nccl`` is DDP at 25 MiB, no hook."""
    for algorithm, cap_mib in {"nccl": 25, "auto": 16, "symm_mem": 16}.items():
        wrapper = BucketedAllReduce(algorithm=algorithm)
        wrapper._enable_symmetric_memory = lambda group, device: algorithm != "nccl"  # as on GPUs
        dmp = _dense_dmp(wrapper, local_group)
        assert wrapper.bucket_cap_bytes == cap_mib << 20, algorithm
        assert (wrapper.hook is None) == (algorithm == "nccl"), algorithm
        assert dmp._dmp_wrapped_module.bucket_bytes_cap == cap_mib << 20, algorithm


class _Stream:
    """A CPU stand-in for a CUDA stream: notes, in ``log``, the streams it is made to wait for
    and when it is current."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device = name, log, torch.device("cuda", 0)

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def __enter__(self) -> None:
        self.log.append(f"{self.name} current")

    def __exit__(self, *exc: object) -> None:
        self.log.append(f"{self.name} no longer current")


class _Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0


def test_symmetric_bucket_runs_on_the_stream_after_main(
    local_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook's CUDA branch, with stand-in streams: the communication stream waits for main,
    then the mean is written into DDP's bucket and the future completed with it there."""
    log: list = []
    main = _Stream("main", log)
    state = SymmetricHook(local_group, "auto", torch.device("cpu"))
    state.stream = _Stream("comm", log)  # type: ignore[assignment]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)
    monkeypatch.setattr(data_parallel, "choose_algorithm", lambda *args: "two_shot")

    def mean(grads: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str) -> list[torch.Tensor]:
        log.append(f"reduce {algorithm}")
        return [g / 2 for g in grads]

    monkeypatch.setattr(data_parallel, "mean_all_reduce", mean)
    flat = torch.ones(4)
    done = symmetric_hook(state, _Bucket(flat))  # type: ignore[arg-type]
    assert log == ["comm waits for main", "comm current", "reduce two_shot", "comm no longer current"]
    assert done.value() is flat and flat.tolist() == [0.5] * 4
    assert state.ran == {0: (16, "two_shot")}


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
    assert wrapper.hook is None and wrapper.bucket_cap_bytes == 25 << 20


def test_unknown_algorithm_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        BucketedAllReduce(algorithm="one_shot")
