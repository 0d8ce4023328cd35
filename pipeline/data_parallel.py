"""Dense-gradient all-reduce for DistributedModelParallel: torchrec's DDP wrapper, whose buckets
go through symmetric memory where the machine's measured table shows a win.

Use as ``DistributedModelParallel(..., data_parallel_wrapper=BucketedAllReduce(algorithm="auto"))``.

What runs. The dense (unsharded) part is wrapped in DDP by torchrec's
``DefaultDataParallelWrapper``: DDP's C++ reducer packs the grads into its flat buckets, starts a
bucket's all-reduce when its last grad lands, so that it overlaps the rest of backward, and makes
the optimizer wait for every bucket (the end of backward waits for their futures). With
``algorithm="nccl"`` that is all: DDP at ``bucket_cap_mb``. With ``"auto"`` or ``"symm_mem"``,
where symmetric memory can be used (CUDA, an NCCL group, ``node_local``), the bucket cap is
lowered to the largest size they reduce through symmetric memory (from the measured table) and a
DDP communication hook (as torchrec's wrapper registers its compression hooks) chooses each
bucket's all-reduce by its size (:func:`~recpipe.ops.all_reduce.choose_algorithm`): NCCL as DDP's
default hook runs it, or one-/two-shot through symmetric memory. Everywhere else (CPU, a group
across nodes) DDP runs unchanged. :meth:`BucketedAllReduce.plan` says what each bucket ran.

Streams and ownership (CUDA), for a bucket that goes through symmetric memory: DDP calls the hook
on the autograd thread with backward's stream (main) current, after it has queued the copies of
the bucket's grads into its flat bucket there. The hook makes the wrapper's communication stream
(high priority, as NCCL's) wait for main, and on it copies the bucket into this process's
persistent symmetric buffer, reduces it, and writes the mean back into DDP's bucket; it then
completes a CUDA future there. DDP waits on the future at the end of backward, which makes main
wait for the communication stream (the future recorded an event on it): the optimizer reads
reduced grads. DDP's bucket is DDP's own memory, never freed while training; the reduction's
temporaries are allocated and read on the communication stream only, so their memory is reused
only by later work on that stream, in stream order. No ``record_stream`` of the hook's.

Why not compiled: the bucket is DDP's flat buffer, not symmetric memory, so one copy into the
symmetric buffer is needed either way; the eager path is that copy, the reduction and the
division (three kernels), which is what inductor would emit, without a graph per bucket size.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.ops.all_reduce import POLICIES, all_reduce_flat, choose_algorithm, symmetric_max_bytes

log = logging.getLogger(__name__)


def mean_all_reduce(
    grads: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str = "auto",
) -> list[torch.Tensor]:
    """The mean of ``grads`` over ``group``'s ranks, as new tensors of the same shapes (one
    flat all-reduce, by ``algorithm``: see :func:`~recpipe.ops.all_reduce.all_reduce_flat`), on
    the current stream. Traceable by torch.compile."""
    flat = all_reduce_flat(grads, group, algorithm)
    # eagerly ``flat`` is a new tensor of this call's own: divided in place, no second
    # bucket-sized tensor per step (traced, inductor fuses the division)
    flat = flat / group.size() if torch.compiler.is_compiling() else flat.div_(group.size())
    return _unflatten_dense_tensors(flat, grads)  # grads' shapes (C++: no per-grad Python)


class SymmetricHook:
    """The DDP communication hook's state (:func:`symmetric_hook`): the group, the policy
    (``"auto"`` or ``"symm_mem"``), the communication stream (CUDA; None on CPU, where the work
    runs when the hook is called), and per bucket index what its last reduction ran: its bytes
    and ``"nccl"``, ``"one_shot"`` or ``"two_shot"``."""

    def __init__(self, group: dist.ProcessGroup, policy: str, device: torch.device) -> None:
        self.group, self.policy = group, policy
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.ran: dict[int, tuple[int, str]] = {}


def symmetric_hook(state: SymmetricHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the mean of ``bucket`` over the ranks, by the algorithm chosen
    for its size (chosen once per bucket index and size: the choice reads the table on the
    host). NCCL: DDP's default hook. Symmetric memory: on ``state.stream`` after what main has
    queued, written back into DDP's bucket, with a future completed there (module docstring)."""
    flat = bucket.buffer()
    nbytes = flat.numel() * flat.element_size()
    ran = state.ran.get(bucket.index())
    if ran is None or ran[0] != nbytes:  # (DDP rebuilds its buckets after the first steps)
        ran = state.ran[bucket.index()] = (
            nbytes, choose_algorithm(nbytes, flat.dtype, flat.device, state.group, state.policy))
    if ran[1] == "nccl":
        return default_hooks.allreduce_hook(state.group, bucket)
    stream = state.stream
    if stream is None:
        return _mean_into(flat, state.group, ran[1])
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with stream:  # torch.Stream as a context: C++, unlike torch.cuda.stream()
        return _mean_into(flat, state.group, ran[1])


# DDP checks the hook's annotations as objects (this module's are strings: ``annotations``)
symmetric_hook.__annotations__.update(bucket=dist.GradBucket, state=SymmetricHook,
                                      **{"return": torch.futures.Future[torch.Tensor]})


def _mean_into(flat: torch.Tensor, group: dist.ProcessGroup, algorithm: str) -> torch.futures.Future[torch.Tensor]:
    """``flat`` = its mean over ``group`` by ``algorithm``, on the current stream; a future
    completed there (on CUDA it records an event on that stream for its waiters)."""
    flat.copy_(mean_all_reduce([flat], group, algorithm)[0])
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[flat.device] if flat.is_cuda else None)
    done.set_result(flat)
    return done


class BucketedAllReduce(DefaultDataParallelWrapper):
    """torchrec's DDP wrapper for the dense part of the model, with buckets that go through
    symmetric memory where that wins (see the module docstring).

    Args:
        bucket_cap_mb: DDP's bucket cap (25, DDP's default); with ``"auto"`` or ``"symm_mem"``
            at most the largest bucket they reduce through symmetric memory, where they do.
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
        return [] if self.hook is None else [self.hook.ran[i] for i in sorted(self.hook.ran)]

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

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        group = env.process_group
        if group is None:
            raise RuntimeError("BucketedAllReduce needs a ProcessGroup-based ShardingEnv")
        symmetric = self._enable_symmetric_memory(group, device)
        if symmetric:  # the cap: the largest bucket that goes through symmetric memory
            module = dmp._dmp_wrapped_module
            sharded = set(DistributedModelParallel._sharded_parameter_names(module))
            dtypes = {p.dtype for n, p in module.named_parameters() if n not in sharded and p.requires_grad}
            caps = [c for d in dtypes if (c := symmetric_max_bytes(d, device, group, self.algorithm))]
            if caps:
                self._bucket_cap_mb = min(self._bucket_cap_mb, min(caps) / 2**20)
        super().wrap(dmp, env, device)
        ddp = dmp._dmp_wrapped_module
        if symmetric and isinstance(ddp, DistributedDataParallel):
            self.hook = SymmetricHook(group, self.algorithm, device)
            ddp.register_comm_hook(self.hook, symmetric_hook)
