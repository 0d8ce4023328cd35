"""BucketedAllReduce's reductions overlap backward (pipeline/data_parallel.py), on 2 ranks (gloo
on CPU; NCCL on 2 GPUs): the optimizer reads every bucket's reduced means although the
reductions are queued while backward goes on and end only when main waits for them (losses
against DDP's and the NCCL fallbacks: tests/test_data_parallel.py).

On CPU the communication stream is replaced by a stand-in that runs the submitted work only when
waited for (a GPU stream far behind the host); on GPUs the real stream runs each reduction
behind a long spin kernel. Either way, a wrapper that let the optimizer read before its wait
gives it the rank's own grads, not the means: the control run without the end-of-backward wait
must see that."""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from group_fixtures import local_group_fixture  # noqa: F401 (fixture)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.pipeline.data_parallel import BucketedAllReduce, CommStream, mean_all_reduce

_SPIN_CYCLES = 40_000_000  # far longer than the host's step: the optimizer would run long
# before the means


class _LaggingStream(CommStream):
    """A CPU stand-in for a communication stream far behind the host: submitted work runs only
    in :meth:`wait`. Notes how many of ``params`` had a grad at each submission."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(torch.device("cpu"))
        self.params = params
        self.queued: list[Callable[[], None]] = []
        self.grads_at_submit: list[int] = []

    def submit(self, work: Callable[[], None]) -> None:
        self.grads_at_submit.append(sum(p.grad is not None for p in self.params))
        self.queued.append(work)

    def wait(self) -> None:
        while self.queued:
            self.queued.pop(0)()


class _CudaStream:
    """A CPU stand-in for a CUDA stream: notes, in ``log``, the streams it is made to wait for
    and when it is current."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device = name, log, torch.device("cuda", 0)

    def wait_stream(self, other: "_CudaStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def __enter__(self) -> None:
        self.log.append(f"{self.name} current")

    def __exit__(self, *exc: object) -> None:
        self.log.append(f"{self.name} no longer current")


def test_cuda_work_runs_on_the_stream_after_main_and_main_waits_before_the_grads_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CommStream's CUDA branch, with stand-in streams: the work waits for main and runs with
    the communication stream current; the stream holds the work's tensors until main has
    waited for it, then lets them go."""
    log: list = []
    main = _CudaStream("main", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: _CudaStream(f"comm{priority}", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)
    comm = CommStream(torch.device("cuda", 0))
    grad = torch.ones(3)
    alive = weakref.ref(grad)
    comm.submit(functools.partial(lambda g: log.append(f"work on {g.numel()}"), grad))
    del grad
    gc.collect()
    assert log == ["comm-1 waits for main", "comm-1 current", "work on 3", "comm-1 no longer current"]
    assert alive() is not None  # held: the stream may still read it
    comm.wait()
    gc.collect()
    assert log[-1] == "main waits for comm-1" and alive() is None
    comm.wait()  # nothing submitted since: no wait
    assert log[-1] == "main waits for comm-1" and len(log) == 5


def _slow_mean(grads: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str) -> list[torch.Tensor]:
    """:func:`mean_all_reduce` behind a spin kernel on the current (communication) stream."""
    if grads[0].is_cuda:
        torch.cuda._sleep(_SPIN_CYCLES)
    return mean_all_reduce(grads, group, algorithm)


def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).double().to(device)


def _optimizer_reads(rank: int, world: int, device: torch.device, wait: bool) -> dict:
    """One SGD step (lr 1) of a data-parallel MLP through BucketedAllReduce: whether the update
    is minus the mean of the ranks' grads (computed here, in one process, on a copy), the
    buckets, and how many grads existed at each submission (CPU). ``wait=False``: the
    end-of-backward callback is never queued (the control)."""
    model = _mlp(device)
    reference = copy.deepcopy(model)
    wrapper = BucketedAllReduce(bucket_cap_mb=1 / 1024, reduce=_slow_mean)  # 1 KiB: 4 buckets
    DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                             device=device, data_parallel_wrapper=wrapper)
    params = list(model.parameters())
    if device.type == "cpu":
        wrapper.comm = _LaggingStream(params)
    if not wait:
        wrapper._backward_started = lambda: None
    optimizer = torch.optim.SGD(params, lr=1.0)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r), dtype=torch.float64).to(device)
          for r in range(world)]
    before = [p.detach().clone() for p in params]
    model(xs[rank]).square().sum().backward()
    optimizer.step()
    read = [b - p.detach() for b, p in zip(before, params)]  # lr 1: the grads the step read
    if device.type == "cuda":
        torch.cuda.synchronize()
    (sum(reference(x).square().sum() for x in xs) / world).backward()
    means = [p.grad for p in reference.parameters()]
    return dict(
        means=all(torch.allclose(r, m, rtol=1e-9, atol=1e-12) for r, m in zip(read, means)),
        buckets=[len(b.params) for b in wrapper.buckets],
        grads_at_submit=getattr(wrapper.comm, "grads_at_submit", None),
    )


def test_the_optimizer_reads_the_means_of_every_bucket() -> None:
    """The reductions are submitted during backward (the first while most grads are still to
    come, one per bucket, in backward's order), run late, and the optimizer still reads the
    means; without the end-of-backward wait it reads the rank's own grads."""
    for result in run_ranks(2, _optimizer_reads, True):
        assert result["buckets"] == [1, 1, 2, 2] and result["means"], result
        if result["grads_at_submit"] is not None:  # CPU: the lagging stand-in
            assert result["grads_at_submit"] == [1, 2, 4, 6], result
    assert [r["means"] for r in run_ranks(2, _optimizer_reads, False)] == [False, False]


def test_a_backward_that_raised_leaves_nothing_behind(local_group: dist.ProcessGroup) -> None:
    """A backward that raised after a bucket's first grads: the next backward counts every
    bucket afresh (it submits each bucket at its own last grad) and still waits at its end."""
    cpu = torch.device("cpu")
    model = _mlp(cpu)
    wrapper = BucketedAllReduce(bucket_cap_mb=2 / 1024)
    DistributedModelParallel(model, env=ShardingEnv.from_process_group(local_group), device=cpu,
                             data_parallel_wrapper=wrapper)
    stream = wrapper.comm = _LaggingStream(list(model.parameters()))
    x = torch.randn(8, 16, dtype=torch.float64)

    def fail(grad: torch.Tensor) -> None:  # after the last layer's grads, before the bias of the
        raise RuntimeError("in backward")  # layer before, in the first bucket

    hidden = model[:3](x)
    hidden.register_hook(fail)
    with pytest.raises(RuntimeError, match="in backward"):
        model[3:](hidden).sum().backward()
    assert [b.ready for b in wrapper.buckets] == [2, 0] and not stream.queued
    model.zero_grad()
    model(x).sum().backward()
    assert stream.grads_at_submit == [4, 6] and not stream.queued

