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
from recpipe.pipeline.data_parallel import BucketedAllReduce, SymmetricHook, _ddp_buckets, symmetric_hook
from recpipe.testing.synthetic import ModelSpec, batches, build_sharded

GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2
STEPS = 100 if GPU2 else 40  # the GPU check's 100; fewer on 2 CPU cores
CAP_MB = 2e-4  # 209 bytes: several buckets of the small model's dense part
M = 1 << 20


_SPIN_CYCLES = 40_000_000  # far longer than the host's step


def _gloo_mean(flat: torch.Tensor, group: dist.ProcessGroup, algorithm: str) -> torch.Tensor:
    """CPU's stand-in for the symmetric-memory mean (gloo)."""
    dist.all_reduce(flat.div_(group.size()), group=group)
    return flat


def _forced(wrapper: BucketedAllReduce) -> BucketedAllReduce:
    """``wrapper`` with its hook on CPU, as if symmetric memory could run there."""
    wrapper._symmetric_cap = lambda module, group, device: int(CAP_MB * 2**20)  # type: ignore[method-assign]
    return wrapper


def _adjust(variant: str, hook: SymmetricHook | None) -> None:
    """After ``wrap``: CPU's ``forced`` variants send every other bucket size through the
    hook's symmetric branch, which means through gloo (``forced``) or leaves the rank's own grads
    (``forced_no_mean``, the control: the optimizer must then see other losses); GPUs'
    ``symm_mem_lagging`` queues each symmetric reduction behind a long spin kernel on the
    communication stream, so that an optimizer not made to wait for it reads the rank's grads."""
    if variant.startswith("forced"):
        assert hook is not None
        hook.choose = lambda nbytes, dtype: "two_shot" if nbytes % 8 else "nccl"
        hook.reduce = _gloo_mean if variant == "forced" else (lambda flat, group, algorithm: flat)
    elif variant == "symm_mem_lagging":
        assert hook is not None
        reduce = hook.reduce

        def lagging(flat: torch.Tensor, group: dist.ProcessGroup, algorithm: str) -> torch.Tensor:
            torch.cuda._sleep(_SPIN_CYCLES)
            return reduce(flat, group, algorithm)

        hook.reduce = lagging


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
        "symm_mem_lagging": lambda: BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="symm_mem"),
        "forced": lambda: _forced(BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto")),
        "forced_no_mean": lambda: _forced(BucketedAllReduce(bucket_cap_mb=CAP_MB, algorithm="auto")),
    }[variant]()
    spec = ModelSpec()
    model, optimizer = build_sharded(
        spec, ["table_wise", "column_wise"], device, torch.distributed.group.WORLD, seed=1,
        data_parallel=wrapper,
    )
    if wrapper is not None:
        _adjust(variant, wrapper.hook)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    it = batches(spec, STEPS, rank, seed=3)
    losses = [pipeline.progress(it)[0].item() for _ in range(STEPS)]
    return losses, [] if wrapper is None else [a for _, a in wrapper.plan()]


def _train_all(rank: int, world: int, device: torch.device, variants: list[str]) -> dict:
    return {v: _train(rank, world, device, v) for v in ["ddp", *variants]}


GPU_VARIANTS = ["symm_mem", "symm_mem_lagging"] if GPU2 else []
CPU_VARIANTS = [] if GPU2 else ["forced", "forced_no_mean"]


def test_losses_match_ddp_and_auto_falls_back_to_ddp() -> None:
    """Every variant's losses are DDP's (rtol 1e-5): the optimizer reads each bucket's mean,
    also where the hook's symmetric branch reduced it (CPU: ``forced``, and the control without
    the mean differs; GPUs: ``symm_mem``, and behind a spin kernel); ``auto`` is DDP's own
    all-reduce (no hook): on CPU, across nodes, and on GPUs, whose table sends these tiny buckets
    through NCCL."""
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
            elif variant.startswith("symm_mem"):  # (the tiny buckets: one-shot, every one)
                assert set(plan) == {"one_shot"}, (variant, plan)
            else:
                assert plan == [], (variant, plan)


def _dense_dmp(wrapper: BucketedAllReduce, group: dist.ProcessGroup, layers: int = 5,
               first: tuple[int, int] = (1024, 1024)) -> DistributedModelParallel:
    """fp32 Linear layers, data-parallel through ``wrapper``: ``first`` (in, out), then
    1024 x 1024 ones (4 MiB weights), ``layers`` in all."""
    model = nn.Sequential(nn.Linear(*first), *[nn.Linear(1024, 1024) for _ in range(layers - 1)])
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(group),
                                    device=torch.device("cpu"), data_parallel_wrapper=wrapper)


def _wrapped(algorithm: str, group: dist.ProcessGroup, **model: object) -> tuple[BucketedAllReduce, DistributedModelParallel]:
    wrapper = BucketedAllReduce(algorithm=algorithm)
    wrapper._enable_symmetric_memory = lambda group, device: algorithm != "nccl"  # as on GPUs
    return wrapper, _dense_dmp(wrapper, group, **model)


def _plan_after_rebuild(wrapper: BucketedAllReduce, dmp: DistributedModelParallel) -> list[tuple[int, str]]:
    """The hook's plan (MiB, algorithm) once DDP has rebuilt its buckets (after the first steps)."""
    assert wrapper.hook is not None
    wrapper.hook.reduce = _gloo_mean  # (no symmetric kernel on CPU)
    for _ in range(3):
        dmp(torch.ones(2, dmp._dmp_wrapped_module.module[0].in_features)).sum().backward()
    return [(b // M, a) for b, a in wrapper.plan()]


def test_ddp_buckets_are_the_ones_ddp_rebuilds(local_group: dist.ProcessGroup) -> None:
    """``_ddp_buckets`` (DDP's assignment over the parameters in reverse order) gives the buckets
    DDP rebuilds in backward's order (4 MiB grads, then a 16 MiB one, under a 5 MiB cap)."""
    wrapper = BucketedAllReduce(bucket_cap_mb=5)
    dmp = _dense_dmp(wrapper, local_group, first=(4096, 1024))
    ddp = dmp._dmp_wrapped_module
    for _ in range(4):  # (DDP's static graph logs its rebuilt buckets at the 4th forward)
        dmp(torch.ones(2, 4096)).sum().backward()
    rebuilt = [int(b) for b in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    assert [b for b, _ in _ddp_buckets(ddp.module, 5 * M)] == rebuilt
    assert len(rebuilt) > 2


@pytest.mark.usefixtures("symmetric_h200")
def test_symm_mem_buckets_fit_the_largest_size_it_reduces(local_group: dist.ProcessGroup) -> None:
    """On the shipped 2 x H200 table (fp32 measured, 200 calls per size), ``symm_mem`` sends fp32
    buckets through symmetric memory up to 16 MiB: DDP's cap leaves room for the largest grad
    (4 MiB), so that once DDP has rebuilt its buckets every one fits; ``nccl`` is DDP at 25 MiB."""
    wrapper, dmp = _wrapped("nccl", local_group)
    assert wrapper.hook is None and dmp._dmp_wrapped_module.bucket_bytes_cap == 25 * M
    wrapper, dmp = _wrapped("symm_mem", local_group)
    assert wrapper.bucket_cap_bytes == dmp._dmp_wrapped_module.bucket_bytes_cap == 16 * M - 4 * M + 1
    # 3 layers' grads (12 MiB + 12 KiB), then 2 (8 MiB + 8 KiB)
    assert _plan_after_rebuild(wrapper, dmp) == [(12, "two_shot"), (8, "two_shot")]


@pytest.mark.usefixtures("symmetric_h200")
def test_auto_keeps_ddps_buckets_with_the_hook_where_one_goes_symmetric(local_group: dist.ProcessGroup) -> None:
    """``auto`` on the shipped H200 table keeps DDP's 25 MiB cap: 20 MiB of grads, one NCCL
    bucket, DDP as it is (no hook); 12 MiB, one bucket that goes two-shot (the hook); a 16 MiB
    grad (the largest symmetric size) does not make the cap a bucket per grad."""
    wrapper, dmp = _wrapped("auto", local_group)
    assert wrapper.hook is None and dmp._dmp_wrapped_module.bucket_bytes_cap == 25 * M
    wrapper, dmp = _wrapped("auto", local_group, layers=3)
    assert wrapper.bucket_cap_bytes == 25 * M
    assert _plan_after_rebuild(wrapper, dmp) == [(12, "two_shot")]
    wrapper, dmp = _wrapped("auto", local_group, first=(4096, 1024))  # a 16 MiB weight
    assert wrapper.hook is None and wrapper.bucket_cap_bytes == 25 * M


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

    def is_last(self) -> bool:
        return True


def test_symmetric_bucket_runs_on_the_stream_after_main(
    local_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook's CUDA branch, with stand-in streams: the communication stream waits for main,
    then the mean is written into DDP's bucket and the future completed with it, both there."""
    log: list = []
    main = _Stream("main", log)
    state = SymmetricHook(local_group, lambda nbytes, dtype: "two_shot", torch.device("cpu"))
    state.stream = _Stream("comm", log)  # type: ignore[assignment]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)

    def mean(flat: torch.Tensor, group: dist.ProcessGroup, algorithm: str) -> torch.Tensor:
        log.append(f"reduce {algorithm}")
        return flat.div_(2)

    def completed(self: torch.futures.Future, value: torch.Tensor) -> None:
        log.append("future completed")
        set_result(self, value)

    set_result = torch.futures.Future.set_result
    monkeypatch.setattr(torch.futures.Future, "set_result", completed)
    state.reduce = mean
    flat = torch.ones(4)
    done = symmetric_hook(state, _Bucket(flat))  # type: ignore[arg-type]
    assert log == ["comm waits for main", "comm current", "reduce two_shot", "future completed",
                   "comm no longer current"]
    assert done.value() is flat and flat.tolist() == [0.5] * 4
    assert state.ran == {0: (16, torch.float32, "two_shot")}


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
