"""Dense-gradient all-reduce for DistributedModelParallel without DDP: bucketed, overlapped with
backward, through :func:`recpipe.ops.all_reduce.all_reduce_sum` (symmetric memory on one NVLink
host, else functional collectives: NCCL, or gloo on CPU), optionally ``torch.compile``'d.

Use as ``DistributedModelParallel(..., data_parallel_wrapper=BucketedAllReduce())``.

Each bucket is a group of dense (unsharded) parameters of one dtype, in reverse registration
order (about the order backward produces their grads), up to ``bucket_cap_mb``. A
``post_accumulate_grad`` hook counts the bucket's ready grads; when the last one lands, the
bucket's grads are flattened, summed across ranks, divided by the world size and copied back
in place, while backward goes on. The reduction runs on the current stream (main), so the
optimizer, queued after backward, reads reduced grads.

With ``symm_mem=True`` (CUDA, NCCL group on one host) symmetric memory is enabled for the group
and each bucket's reduction is compiled with static shapes through
:func:`~recpipe.ops.all_reduce.compile_symmetric`: inductor then allocates the bucket's flat
gradient (the ``cat``, computed in the graph) in symmetric memory and reduces it there with no
extra copy. Buckets above ``SYMM_MAX_BYTES`` or of other dtypes go through NCCL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.ops.all_reduce import SYMM_MAX_BYTES, all_reduce_sum, compile_symmetric

Reduce = Callable[[list[torch.Tensor], dist.ProcessGroup], list[torch.Tensor]]
_RECOMPILE_LIMIT = 1024  # graphs of the reduction per process: one per bucket shape


def mean_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The mean of ``grads`` over ``group``'s ranks, as new tensors of the same shapes (one
    flat all-reduce). Traceable by torch.compile."""
    flat = all_reduce_sum(torch.cat([g.reshape(-1) for g in grads]), group)
    flat = flat / dist.get_world_size(group)
    return [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], owner: "BucketedAllReduce", reduce: Reduce) -> None:
        self.params = params
        self.owner = owner
        self.reduce = reduce
        self.ready = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: nn.Parameter) -> None:
        self.owner._backward_started()
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0
        grads = [p.grad for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(grads, self.reduce(grads, self.owner._group))


def _buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of one dtype and device, each up to ``cap_bytes`` (or one tensor)."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):  # backward produces the last layers' grads first
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > cap_bytes or (out[-1][0].dtype, out[-1][0].device) != (
            p.dtype, p.device,
        ):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class BucketedAllReduce(DataParallelWrapper):
    """A torchrec ``DataParallelWrapper`` replacing DDP for the dense part of the model.

    Args:
        bucket_cap_mb: bucket size (DDP's default is 25; with ``symm_mem`` at most
            ``SYMM_MAX_BYTES``, the largest size it reduces through symmetric memory).
        compile: reduce each bucket through ``torch.compile(fullgraph=True)``.
        reduce: the bucket reduction, :func:`mean_all_reduce` by default.
        symm_mem: reduce through symmetric memory (compiled; see the module docstring).
    """

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        compile: bool = False,
        reduce: Reduce = mean_all_reduce,
        symm_mem: bool = False,
    ) -> None:
        self._cap = int(bucket_cap_mb * 2**20)
        if symm_mem:  # larger buckets would go through NCCL
            self._cap = min(self._cap, SYMM_MAX_BYTES)
        self._symm_mem = symm_mem
        self._compile = compile or symm_mem
        self._reduce = reduce
        self._group: dist.ProcessGroup | None = None
        self._checking = False
        self.buckets: list[_Bucket] = []

    def _bucket_reduce(self) -> Reduce:
        """The reduction of one bucket. Compiled: static shapes (symmetric buffers cannot have
        dynamic ones), so one graph per bucket; dynamo keeps the graphs of one function
        together (over every wrapper in the process), so its recompile limit is raised for
        these calls: with ``fullgraph=True`` reaching it would be an error."""
        if not self._compile:
            return self._reduce
        if self._symm_mem:
            compiled = compile_symmetric(self._reduce)
        else:
            compiled = torch.compile(self._reduce, fullgraph=True, dynamic=False)

        def reduce(grads: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
            # Set and restored by hand: ``config.patch`` costs ~250 us per call (per bucket
            # and step, in backward), this ~4 us.
            config = torch._dynamo.config
            saved, config.recompile_limit = config.recompile_limit, _RECOMPILE_LIMIT
            try:
                return compiled(grads, group)
            finally:
                config.recompile_limit = saved

        return reduce

    def _backward_started(self) -> None:
        """On a backward's first dense grad: check, once it ends, that every bucket reduced."""
        if not self._checking:
            self._checking = True
            torch.autograd.Variable._execution_engine.queue_callback(self._check_all_reduced)

    def _check_all_reduced(self) -> None:
        self._checking = False
        missing = [b for b in self.buckets if b.ready]
        for b in missing:
            b.ready = 0
        if missing:
            raise RuntimeError(
                "BucketedAllReduce: some dense parameters got no gradient in this backward, so "
                "their buckets were not reduced (unused parameters are not supported)"
            )

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        group = env.process_group
        if group is None:
            raise RuntimeError("BucketedAllReduce needs a ProcessGroup-based ShardingEnv")
        if self._symm_mem:
            if device.type != "cuda" or dist.get_backend(group) != "nccl":
                raise ValueError("BucketedAllReduce(symm_mem=True) needs CUDA and an NCCL group")
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(group.group_name)
        module = dmp._dmp_wrapped_module
        sharded = set(DistributedModelParallel._sharded_parameter_names(module))
        dense = [p for n, p in module.named_parameters() if n not in sharded and p.requires_grad]
        with torch.no_grad():  # start from rank 0's dense weights, as DDP does
            for p in dense:
                dist.broadcast(p, src=dist.get_global_rank(group, 0), group=group)
        self._group = group
        self.buckets = [_Bucket(b, self, self._bucket_reduce()) for b in _buckets(dense, self._cap)]
