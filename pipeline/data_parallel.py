"""Dense-gradient all-reduce for DistributedModelParallel without DDP: bucketed, overlapped with
backward, through functional collectives (so ``torch.compile`` can trace the reduction).

Use as ``DistributedModelParallel(..., data_parallel_wrapper=BucketedAllReduce())``.

Each bucket is a group of dense (unsharded) parameters of one dtype, in reverse registration
order (about the order backward produces their grads), up to ``bucket_cap_mb``. A
``post_accumulate_grad`` hook counts the bucket's ready grads; when the last one lands, the
bucket's grads are flattened, summed across ranks, divided by the world size and copied back
in place, while backward goes on. The reduction runs on the current stream (main), so the
optimizer, queued after backward, reads reduced grads.

With ``symm_mem=True`` (CUDA, NCCL group; compiled), inductor's own collective lowering is
switched on for the reduction (``_collective.auto_select``, threshold = the bucket size) and
symmetric memory is enabled for the group: inductor then allocates each bucket's flat gradient
(a computed input: the ``cat``) in symmetric memory and calls
``symm_mem.one_shot_all_reduce`` on it, with no extra copy. NOT YET RUN on a GPU: measure it
with NCCL as the peer before relying on it (issue 6). Multicast stays off
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``); one-shot does not use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

Reduce = Callable[[list[torch.Tensor], dist.ProcessGroup], list[torch.Tensor]]


def mean_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The mean of ``grads`` over ``group``'s ranks, as new tensors of the same shapes (one
    flat all-reduce). Traceable by torch.compile."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = funcol.all_reduce(flat, "sum", group) / dist.get_world_size(group)
    return [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], owner: "BucketedAllReduce") -> None:
        self.params = params
        self.owner = owner
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
            torch._foreach_copy_(grads, self.owner._reduce(grads, self.owner._group))


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
        bucket_cap_mb: bucket size (DDP's default is 25).
        compile: reduce each bucket through ``torch.compile(fullgraph=True)``.
        reduce: the bucket reduction, :func:`mean_all_reduce` by default.
        symm_mem: compiled one-shot all-reduce from symmetric memory (see the module docs).
    """

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        compile: bool = False,
        reduce: Reduce = mean_all_reduce,
        symm_mem: bool = False,
    ) -> None:
        self._cap = int(bucket_cap_mb * 2**20)
        self._symm_mem = symm_mem
        if symm_mem:
            compiled = torch.compile(reduce, fullgraph=True)

            def reduce(grads: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
                with torch._inductor.config.patch(
                    {"_collective.auto_select": True,
                     "_collective.one_shot_all_reduce_threshold_bytes": self._cap}
                ):
                    return compiled(grads, group)

            self._reduce = reduce
        else:
            self._reduce = torch.compile(reduce, fullgraph=True) if compile else reduce
        self._group: dist.ProcessGroup | None = None
        self._checking = False
        self.buckets: list[_Bucket] = []

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
        self.buckets = [_Bucket(b, self) for b in _buckets(dense, self._cap)]
