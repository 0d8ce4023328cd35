"""Dense-gradient all-reduce for DistributedModelParallel: torchrec's DDP wrapper, whose buckets
go through symmetric memory where the machine's measured table shows a win.

Use as ``DistributedModelParallel(..., data_parallel_wrapper=BucketedAllReduce(algorithm="auto"))``.

What runs. The dense (unsharded) part is wrapped in DDP by torchrec's
``DefaultDataParallelWrapper``: DDP's C++ reducer packs the grads into its flat buckets, starts a
bucket's all-reduce when its last grad lands, so that it overlaps the rest of backward, and makes
the optimizer wait for every bucket (the end of backward waits for their futures). With
``algorithm="nccl"`` that is all: DDP at ``bucket_cap_mb``. With ``"auto"`` or ``"symm_mem"``,
where symmetric memory can be used (CUDA, an NCCL group, ``node_local``) and some bucket would
go through it, a DDP communication hook (as torchrec's wrapper registers its compression hooks)
chooses each bucket's all-reduce by its size (:func:`~recpipe.ops.all_reduce.choose_algorithm`):
NCCL as DDP's default hook runs it (divide, then sum), or one-/two-shot through symmetric memory
(:func:`~recpipe.ops.all_reduce.symmetric_mean_`: divided while copied into the persistent
symmetric buffer, summed back into the bucket). ``"auto"`` keeps DDP's buckets: on the shipped
H200 table their latencies, summed, beat buckets split to fit symmetric memory, and with a
bucket per grad ``auto`` lost where the host sets the pace
(docs/results/ddp-comm-hook_2xH200_2026-11-28.md). ``"symm_mem"`` lowers
DDP's bucket cap so that every bucket fits the largest size it reduces through symmetric memory.
Everywhere else (CPU, a group across nodes, no bucket that would go through symmetric memory)
DDP runs unchanged. :meth:`BucketedAllReduce.plan` says what each bucket ran.

Streams and ownership (CUDA), for a bucket that goes through symmetric memory: DDP calls the hook
with backward's stream (main) current, after it has queued the copies of the bucket's grads
into its flat bucket there (on the autograd thread as the bucket's last grad lands; in the first
steps under DDP's static graph, from its end-of-backward callback). The hook makes the wrapper's
communication stream (high priority, as NCCL's) wait for main, reduces the bucket in place
there, and completes a CUDA future there. DDP waits on the future at the end of backward, which
makes main wait for the communication stream (the future recorded an event on it): the
optimizer reads reduced grads. DDP's bucket is DDP's own memory, never freed while training; the
symmetric buffer is reused only by the next reduction on the same stream. No ``record_stream``.

Not compiled: the bucket is DDP's flat buffer, not symmetric memory, so one copy into the
symmetric buffer is needed either way; eagerly it carries the division, and the kernel writes
the sum straight back into the bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.ops.all_reduce import POLICIES, choose_algorithm, symmetric_max_bytes, symmetric_mean_

log = logging.getLogger(__name__)


Reduce = Callable[[torch.Tensor, dist.ProcessGroup, str], torch.Tensor]
#: ``choose(nbytes, dtype)``: a bucket's algorithm, ``"nccl"``, ``"one_shot"`` or ``"two_shot"``
Choose = Callable[[int, torch.dtype], str]


class SymmetricHook:
    """The DDP communication hook's state (:func:`symmetric_hook`).

    Attributes:
        group: the process group.
        choose: a bucket's algorithm by its bytes and dtype (the measured table's choice).
        reduce: ``reduce(flat, group, algorithm)``, the symmetric-memory mean of a bucket, in
            place on the current stream (:func:`~recpipe.ops.all_reduce.symmetric_mean_`).
        stream: where the symmetric reductions run (CUDA; None on CPU: when the hook is called).
        ran: per bucket index, its bytes, dtype and algorithm in the last backward.
    """

    def __init__(self, group: dist.ProcessGroup, choose: Choose, device: torch.device,
                 reduce: Reduce = symmetric_mean_) -> None:
        self.group, self.choose, self.reduce = group, choose, reduce
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.ran: dict[int, tuple[int, torch.dtype, str]] = {}


def symmetric_hook(state: SymmetricHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: ``bucket`` becomes its mean over the ranks, by the algorithm
    chosen for its size and dtype (once per bucket: the choice reads the table on the host).
    NCCL: DDP's default hook. Symmetric memory: on ``state.stream`` after what the current
    stream (backward's) has queued, in place in DDP's bucket, with a future completed there (the
    module docstring)."""
    flat = bucket.buffer()
    nbytes, index = flat.numel() * flat.element_size(), bucket.index()
    ran = state.ran.get(index)
    if ran is None or ran[:2] != (nbytes, flat.dtype):  # (DDP rebuilds its buckets once)
        ran = state.ran[index] = (nbytes, flat.dtype, state.choose(nbytes, flat.dtype))
    if bucket.is_last():  # (a rebuild may leave fewer buckets)
        for stale in [i for i in state.ran if i > index]:
            del state.ran[stale]
    if ran[2] == "nccl":
        return default_hooks.allreduce_hook(state.group, bucket)
    stream = state.stream
    if stream is None:
        return _reduced(state, flat, ran[2])
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with stream:  # torch.Stream as a context: C++, unlike torch.cuda.stream()
        return _reduced(state, flat, ran[2])


# DDP checks the hook's annotations as objects (this module's are strings: ``annotations``)
symmetric_hook.__annotations__.update(bucket=dist.GradBucket, state=SymmetricHook,
                                      **{"return": torch.futures.Future[torch.Tensor]})


def _reduced(state: SymmetricHook, flat: torch.Tensor, algorithm: str) -> torch.futures.Future[torch.Tensor]:
    """``state.reduce`` of ``flat`` on the current stream, and a future completed with it there
    (on CUDA it records an event on that stream, which DDP's wait makes main wait for)."""
    state.reduce(flat, state.group, algorithm)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[flat.device] if flat.is_cuda else None)
    done.set_result(flat)
    return done


def _ddp_buckets(module: nn.Module, cap: int) -> list[tuple[int, torch.dtype]]:
    """The bytes and dtype of each bucket DDP makes of ``module``'s dense (unsharded) trainable
    grads under ``cap``, by DDP's own assignment over the parameters in reverse order: the order
    in which backward makes the grads, about, in which DDP rebuilds its buckets."""
    sharded = set(DistributedModelParallel._sharded_parameter_names(module))
    params = [p for n, p in reversed(list(module.named_parameters()))
              if n not in sharded and p.requires_grad]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [cap], [False] * len(params))
    return [(sum(params[i].numel() * params[i].element_size() for i in b), params[b[0]].dtype)
            for b in buckets]


class BucketedAllReduce(DefaultDataParallelWrapper):
    """torchrec's DDP wrapper for the dense part of the model, with buckets that go through
    symmetric memory where that wins (see the module docstring).

    Args:
        bucket_cap_mb: DDP's bucket cap (25, DDP's default); with ``"symm_mem"`` lowered so
            that DDP's buckets fit the largest size it reduces through symmetric memory.
        algorithm: ``"nccl"`` (DDP as it is), ``"auto"`` (per bucket, NCCL or the symmetric
            algorithm the measured table of :mod:`recpipe.ops.all_reduce_table` shows faster
            for its size: a symmetric one only where the upper end of its latency ratio's 95%
            interval is below 1 by the table's margin; NCCL where no table was measured for the
            GPU and world size) or ``"symm_mem"`` (symmetric memory for every bucket it can
            reduce).
        node_local: whether the group's ranks are all on one node; if not, symmetric memory
            stays off and DDP runs unchanged.

    Attributes:
        hook: the communication hook's state once ``wrap`` registered it (None where DDP runs
            unchanged).
    """

    def __init__(self, bucket_cap_mb: float = 25, algorithm: str = "nccl", node_local: bool = True) -> None:
        if algorithm not in POLICIES:
            raise ValueError(f"BucketedAllReduce(algorithm={algorithm!r}): expected one of {POLICIES}")
        super().__init__(bucket_cap_mb=bucket_cap_mb)  # type: ignore[arg-type]  # (DDP takes floats)
        self.algorithm = algorithm
        self._node_local = node_local
        self.hook: SymmetricHook | None = None

    @property
    def bucket_cap_bytes(self) -> int:
        """DDP's bucket cap, as ``wrap`` set it."""
        return int(self._bucket_cap_mb * 2**20)

    def plan(self) -> list[tuple[int, str]]:
        """Per DDP bucket, by index: its bytes and the all-reduce its last reduction ran
        (``"nccl"``, ``"one_shot"`` or ``"two_shot"``). Empty before the first backward, and where
        DDP runs unchanged (its own NCCL all-reduce for every bucket)."""
        return [] if self.hook is None else [(b, a) for b, _, a in (self.hook.ran[i] for i in sorted(self.hook.ran))]

    def _enable_symmetric_memory(self, group: dist.ProcessGroup, device: torch.device) -> bool:
        """Enable symmetric memory for ``group`` if ``algorithm`` may use it and it can run there;
        whether it did."""
        if self.algorithm == "nccl":
            return False
        if not self._node_local:
            log.info("BucketedAllReduce(algorithm=%r): the process group spans nodes, so every "
                     "bucket goes through NCCL", self.algorithm)
            return False
        if device.type != "cuda" or dist.get_backend(group) != "nccl":
            if self.algorithm == "symm_mem":
                raise ValueError("BucketedAllReduce(algorithm='symm_mem') needs CUDA and an NCCL group")
            return False  # "auto": NCCL (gloo on CPU)
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
        return True

    def _symmetric_cap(self, module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> int:
        """DDP's bucket cap in bytes where ``algorithm`` sends buckets through symmetric memory
        (which this enables for ``group``); 0 where none would go through it (DDP then runs
        unchanged, without the hook). ``"auto"``: DDP's own cap, where the table sends one of
        DDP's buckets through symmetric memory. ``"symm_mem"``: lowered so that every bucket
        fits the largest size it reduces through symmetric memory: DDP closes a bucket at the
        first grad that takes it to the cap, so a bucket exceeds the cap by up to one grad less
        a byte, and the cap leaves room for the largest grad that fits (down to a bucket per
        grad, where a grad is that size)."""
        if not self._enable_symmetric_memory(group, device):
            return 0
        if self.algorithm == "auto":
            choose = partial(choose_algorithm, device=device, group=group, algorithm="auto")
            own = self.bucket_cap_bytes
            return own if any(choose(b, d) != "nccl" for b, d in _ddp_buckets(module, own)) else 0
        grads = _ddp_buckets(module, 1)  # (a bucket per grad)
        most = {d: symmetric_max_bytes(d, device, group, self.algorithm) for _, d in grads}
        return min((most[d] - b + 1 for b, d in grads if b <= most[d]), default=0)

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        group = env.process_group
        if group is None:
            raise RuntimeError("BucketedAllReduce needs a ProcessGroup-based ShardingEnv")
        cap = self._symmetric_cap(dmp._dmp_wrapped_module, group, device)
        if cap:
            self._bucket_cap_mb = min(self._bucket_cap_mb, cap / 2**20)
        super().wrap(dmp, env, device)
        ddp = dmp._dmp_wrapped_module
        if cap and isinstance(ddp, DistributedDataParallel):
            choose = partial(choose_algorithm, device=device, group=group, algorithm=self.algorithm)
            self.hook = SymmetricHook(group, choose, device)
            ddp.register_comm_hook(self.hook, symmetric_hook)

