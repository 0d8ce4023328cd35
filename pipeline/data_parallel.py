"""Dense-gradient all-reduce for DistributedModelParallel without DDP: bucketed, overlapped with
backward on a communication stream, through :func:`recpipe.ops.all_reduce.all_reduce_flat`
(NCCL, or symmetric memory on one NVLink host; gloo on CPU), optionally ``torch.compile``'d.

Use as ``DistributedModelParallel(..., data_parallel_wrapper=BucketedAllReduce())``.

Buckets. Each bucket is a group of dense (unsharded) parameters of one dtype, in reverse
registration order (about the order backward produces their grads), up to the bucket cap
(:class:`BucketedAllReduce`'s ``bucket_cap_mb``, lowered by ``"auto"`` and ``"symm_mem"`` to the
largest size they reduce through symmetric memory, from the machine's measured table).
Consecutive grads are packed up to the cap, so where the grads are small next to it the buckets
come near it, where the table shows symmetric memory winning. A gradient larger than the cap
closes the bucket being filled, with the grads before it (NCCL's range), much as DDP's buckets
do: a reduction less per step, which a host-bound step pays in Python, for a later start of
those grads (its layer's bias lands with it; a smaller layer's grads, one layer earlier). It is
not split into symmetric-size pieces: they would all land at once (no earlier start), and
NCCL's cost per byte at large sizes is below two-shot's at the cap
(docs/results/overlap-allreduce_2xH200_2026-11-28.md). What is left at the end (the first
layers' grads, which backward produces last) is the last bucket: the only reduction that cannot
overlap backward.

Overlap. A ``post_accumulate_grad`` hook counts the bucket's ready grads. When its last one
lands, the bucket's reduction is queued on the wrapper's :class:`CommStream`: on CUDA a
dedicated stream (high priority, as NCCL's own), made to wait (an event) for what the current
stream (the one backward runs its AccumulateGrad on: main) has queued so far, so for the
bucket's grads; there the grads are summed across ranks as one flat tensor, divided by the
world size and copied back into the grads in place, while main goes on with backward. At a
backward's first dense grad, a callback is queued on the autograd engine (``queue_callback``,
as DDP's reducer does); it runs when that backward ends, on the stream that called
``backward()`` (main), and makes that stream wait for the communication stream: the optimizer,
and anything else queued on main after ``backward()``, reads reduced grads. One backward at a
time: after a backward that raised, the next one first waits for the reductions it left and
counts afresh; one run inside another's (reentrant checkpointing of dense layers) is not
supported.

Streams and ownership (CUDA):

- the grads (``param.grad``) are allocated on main by autograd; from the event of their
  bucket's launch until the end-of-backward wait, only the communication stream reads and
  writes them (backward does not touch a leaf's grad after its AccumulateGrad). The stream
  holds the submitted work, and so Python references to those grads, until main has waited
  for it: a grad freed or replaced later (``zero_grad(set_to_none=True)``) goes back to main's
  pool after main's wait, so no kernel of main reuses its memory while the reduction may still
  read it. No ``record_stream``: the caching allocator would have to query an event at each such
  free, and would hold the blocks back from main's pool until then.
- the bucket's flat gradient, the reduced sum and the divided means are allocated on the
  communication stream and used only there (the NCCL path's c10d call is synchronous, so
  ordered on that stream); dropped when the work returns, their memory is reused only by later
  work on the same stream, in stream order.
- the symmetric-memory paths run on the communication stream too: inductor's symmetric buffer of
  each compiled graph, and :func:`~recpipe.ops.all_reduce.symmetric_buffer`, are reused by the
  next call on that stream, in stream order.

On CPU (gloo) there are no streams: the same code runs the work when it is submitted (gloo's
collectives return when done) and the end-of-backward wait has nothing to wait for. The tests
put a stand-in stream there that runs the work only when waited on, as a GPU stream far behind
the host would: the optimizer must still see the reduced means.

``algorithm`` picks each bucket's all-reduce (:data:`~recpipe.ops.all_reduce.POLICIES`):
``"nccl"``; ``"auto"``, NCCL or a symmetric-memory algorithm, whichever the measured table of
:mod:`recpipe.ops.all_reduce_table` says is faster for the bucket's size (a symmetric one only
where the upper end of its latency ratio's 95% interval, or in a table without intervals its
P50 ratio, is below 1 by the table's margin);
``"symm_mem"``, symmetric memory for every bucket it can reduce. The latter two enable symmetric
memory for the group when it can be used there (CUDA, an NCCL group, ``node_local``), lower the
bucket cap as above, and compile the reduction of each bucket that goes through symmetric memory,
with static shapes, through :func:`~recpipe.ops.all_reduce.compile_symmetric`: inductor then
allocates the bucket's flat gradient (the ``cat``, computed in the graph) in symmetric memory and
reduces it there with no extra copy. Where symmetric memory cannot be used (CPU, a group across
nodes), every bucket goes through NCCL (gloo on CPU); ``"auto"`` also sends every bucket through
NCCL where no table was measured for the GPU and world size. A bucket that goes through NCCL
runs eagerly (c10d's ``all_reduce``), unless ``compile=True``.
:meth:`BucketedAllReduce.plan` says what each bucket runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from recpipe.ops.all_reduce import (
    POLICIES,
    all_reduce_flat,
    choose_algorithm,
    compile_symmetric,
    symmetric_max_bytes,
)

log = logging.getLogger(__name__)

#: ``reduce(grads, group, algorithm)``: ``algorithm`` is the bucket's: ``"nccl"``, ``"one_shot"``
#: or ``"two_shot"`` (:meth:`BucketedAllReduce.plan`)
Reduce = Callable[[list[torch.Tensor], dist.ProcessGroup, str], list[torch.Tensor]]
_RECOMPILE_LIMIT = 1024  # graphs of the reduction per process: one per bucket shape


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


class CommStream:
    """Where the buckets' reductions run while backward goes on (see the module docstring).

    CUDA: a dedicated stream, of high priority (as NCCL's: the reduction's kernels get SMs
    ahead of backward's queued ones). :meth:`submit` makes it wait for what the current stream
    has queued, queues the work there and holds the work (so the tensors it references) until
    :meth:`wait`, which makes the current stream wait for all of it. CPU: no stream (``stream``
    is None): the work runs when submitted, and :meth:`wait` has nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._held: list[Callable[[], None]] = []

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` (host code queuing kernels) after everything queued so far on the
        current stream; call from the stream whose work it reads (backward's: main)."""
        if self.stream is None:
            work()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with self.stream:  # torch.Stream as a context: C++, unlike torch.cuda.stream()
            work()
        self._held.append(work)

    def wait(self) -> None:
        """Make the current stream wait for all submitted work, then drop the work (and the
        references it holds: safe once the current stream, which will free them, waited)."""
        if self.stream is not None and self._held:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self._held.clear()


class _Bucket:
    def __init__(self, params: list[nn.Parameter], owner: "BucketedAllReduce", algorithm: str,
                 reduce: Reduce) -> None:
        self.params = params
        self.owner = owner
        self.algorithm = algorithm  # what ``reduce`` is asked for: "nccl", "one_shot" or "two_shot"
        self.reduce = reduce
        self.ready = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.params)

    def _on_grad(self, param: nn.Parameter) -> None:
        self.owner._backward_started()
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0
        self.owner.comm.submit(functools.partial(self._reduce_in_place, [p.grad for p in self.params]))

    def _reduce_in_place(self, grads: list[torch.Tensor]) -> None:
        """``grads`` = their mean over the ranks, queued on the current stream (the
        communication stream)."""
        owner = self.owner
        with torch.no_grad():
            torch._foreach_copy_(grads, self.reduce(grads, owner._group, self.algorithm))


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _buckets(
    params: list[nn.Parameter], cap_bytes: Callable[[torch.dtype], int],
) -> list[list[nn.Parameter]]:
    """Consecutive groups of one dtype and device, each up to ``cap_bytes(dtype)``, except that
    a tensor larger than its cap closes the group being filled, with the tensors before it."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):  # backward produces the last layers' grads first
        nbytes, cap = p.numel() * p.element_size(), cap_bytes(p.dtype)
        same = bool(out) and (out[-1][0].dtype, out[-1][0].device) == (p.dtype, p.device)
        if not same or (size + nbytes > cap and not size < cap < nbytes):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class BucketedAllReduce(DataParallelWrapper):
    """A torchrec ``DataParallelWrapper`` replacing DDP for the dense part of the model.

    Args:
        bucket_cap_mb: bucket size (DDP's default is 25); with ``"auto"`` or ``"symm_mem"`` at
            most the largest bucket they reduce through symmetric memory, where they do (from
            the measured table).
        compile: reduce the buckets that go through NCCL through ``torch.compile(fullgraph=True)``
            too (those that go through symmetric memory always are).
        reduce: the bucket reduction, :func:`mean_all_reduce` by default: new tensors (the
            means), computed on the current stream, which is the communication stream.
        algorithm: ``"nccl"``, ``"auto"`` or ``"symm_mem"`` (see the module docstring).
        node_local: whether the group's ranks are all on one node; if not, symmetric memory
            stays off and every bucket goes through NCCL.

    Attributes:
        comm: the :class:`CommStream` the reductions run on (``wrap`` makes it for the device).
    """

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        compile: bool = False,
        reduce: Reduce = mean_all_reduce,
        algorithm: str = "nccl",
        node_local: bool = True,
    ) -> None:
        if algorithm not in POLICIES:
            raise ValueError(f"BucketedAllReduce(algorithm={algorithm!r}): expected one of {POLICIES}")
        self.algorithm = algorithm
        self._cap = int(bucket_cap_mb * 2**20)
        self._compile = compile
        self._node_local = node_local
        self._reduce = reduce
        self._group: dist.ProcessGroup | None = None
        self._graph_task = -1  # the autograd graph task whose end waits for the reductions
        self.buckets: list[_Bucket] = []
        self.comm = CommStream(torch.device("cpu"))

    def plan(self) -> list[tuple[int, str]]:
        """Per bucket, in reduction order: its bytes and the all-reduce :func:`mean_all_reduce`
        runs for it (``"nccl"``, ``"one_shot"`` or ``"two_shot"``). Empty before ``wrap``."""
        return [(b.nbytes, b.algorithm) for b in self.buckets]

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

    def _compiled_reduce(self, symmetric: bool) -> Reduce:
        """The compiled reduction of a bucket: static shapes (symmetric buffers cannot have
        dynamic ones), so one graph per bucket; dynamo keeps the graphs of one function
        together (over every wrapper in the process), so its recompile limit is raised for
        these calls: with ``fullgraph=True`` reaching it would be an error."""
        if symmetric:
            compiled = compile_symmetric(self._reduce)
        else:
            compiled = torch.compile(self._reduce, fullgraph=True, dynamic=False)

        def reduce(grads: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str) -> list[torch.Tensor]:
            # Set and restored by hand: ``config.patch`` costs far more per call (per bucket
            # and step, in backward).
            config = torch._dynamo.config
            saved, config.recompile_limit = config.recompile_limit, _RECOMPILE_LIMIT
            try:
                return compiled(grads, group, algorithm)
            finally:
                config.recompile_limit = saved

        return reduce

    def _backward_started(self) -> None:
        """On each dense grad: at a backward's first, queue the wait for its reductions at its
        end, and start every bucket's count afresh (a backward that raised left some counted,
        and reductions that main has not waited for: it waits now)."""
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:
            self._graph_task = task
            self.comm.wait()
            for b in self.buckets:
                b.ready = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        """The engine's final callback, on the stream that called ``backward()``: it waits for
        every bucket's reduction; then checks that every bucket was reduced."""
        self.comm.wait()
        if any(b.ready for b in self.buckets):  # (counted afresh at the next backward)
            raise RuntimeError(
                "BucketedAllReduce: some dense parameters got no gradient in this backward, so "
                "their buckets were not reduced (unused parameters are not supported)"
            )

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        group = env.process_group
        if group is None:
            raise RuntimeError("BucketedAllReduce needs a ProcessGroup-based ShardingEnv")
        symmetric = self._enable_symmetric_memory(group, device)
        module = dmp._dmp_wrapped_module
        sharded = set(DistributedModelParallel._sharded_parameter_names(module))
        dense = [p for n, p in module.named_parameters() if n not in sharded and p.requires_grad]
        with torch.no_grad():  # start from rank 0's dense weights, as DDP does
            for p in dense:
                dist.broadcast(p, src=dist.get_global_rank(group, 0), group=group)
        self._group = group
        self.comm = CommStream(device)

        @functools.cache
        def cap(dtype: torch.dtype) -> int:  # the bucket cap, or the largest symmetric bucket
            return min(self._cap, symmetric_max_bytes(dtype, device, group, self.algorithm) or self._cap)

        # A bucket that goes through NCCL runs eagerly unless ``compile``: a compiled call costs
        # the host more than the few kernels it queues (guards, the graph's wrappers), which a
        # host-bound step pays per bucket.
        compiled = self._compiled_reduce(symmetric) if symmetric or self._compile else None
        self.buckets = []
        for params in _buckets(dense, cap):
            algorithm = choose_algorithm(_nbytes(params), params[0].dtype, device, group,
                                         self.algorithm if symmetric else "nccl")
            eager = algorithm == "nccl" and not self._compile
            self.buckets.append(_Bucket(params, self, algorithm, self._reduce if eager else compiled))
