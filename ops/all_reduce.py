"""Sum all-reduce for dense-gradient buckets: symmetric memory on one NVLink host, NCCL beyond
it, gloo on CPU; traceable by ``torch.compile``, with no copy for inputs computed in the graph.

    from recpipe.ops.all_reduce import all_reduce_sum
    total = all_reduce_sum(x, group)    # a new tensor: the sum of x over the group's ranks

:func:`all_reduce_sum` picks the path on the host (:func:`uses_symmetric_memory`): symmetric
memory for fp32/bf16 tensors of up to ``SYMM_MAX_BYTES`` on CUDA, in an NCCL group on one host
that has symmetric memory enabled (``enable_symm_mem_for_group``); else
``funcol.all_reduce`` (NCCL, or gloo on CPU). The symmetric path is two custom ops:

- ``recpipe::symm_all_reduce(Tensor input, str group_name) -> Tensor``: ``input`` must be
  symmetric memory; the one-shot kernel (every rank reads every peer's buffer; ``input`` is
  left intact) writes the sum to a new tensor.
- ``recpipe::symm_all_reduce_copy(Tensor input, str group_name) -> Tensor``: any input; one
  ``copy_`` (a device-to-device memcpy: copy engine, no SMs) into this process's persistent
  symmetric buffer for (group, dtype, device), then one-shot, or two-shot above
  ``ONE_SHOT_MAX_BYTES`` at world sizes 2, 4 and 8 (two-shot uses its input as scratch, which
  only a private buffer allows).

Under ``torch.compile`` the inductor lowering registered here (the same code on torch 2.11 and
2.13; importing this module registers it) chooses per call:

1. the input is computed in the graph with a static shape: its producer writes straight into a
   symmetric buffer (inductor's ``empty_strided_p2p``) and ``symm_all_reduce`` runs on it, no
   copy (except from 4 ranks above ``ONE_SHOT_MAX_BYTES``, where two-shot after a copy moves
   fewer bytes: :func:`one_shot_in_place`);
2. otherwise (a graph input, or a buffer inductor does not allocate itself):
   ``symm_all_reduce_copy``, one DMA copy (where inductor itself would add an identity Triton
   kernel on 2.13, or fail on 2.11). Inductor drops a ``cat`` of one tensor, so a
   one-parameter bucket takes this path.

Eager calls take path 2. Compile with inductor (another backend would pass ordinary memory to
``symm_all_reduce``), through :func:`compile_symmetric`: inductor names each
symmetric buffer with an id drawn from Python's ``random``, which dynamo reseeds per frame, so
two graphs would get the same id (and the allocator refuses a second live buffer or a new size
under one id); it draws them from ``SystemRandom`` instead and keeps these graphs out of the FX
graph cache. No CUDA graphs, no multicast (one- and two-shot read peers' buffers directly).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

SYMM_DTYPES = (torch.float32, torch.bfloat16)  # the kernels' dtypes (sum only)
SYMM_MAX_BYTES = 16 << 20  # above: NCCL (to be tuned with scripts/bench_allreduce.py)
ONE_SHOT_MAX_BYTES = 1 << 20  # copy path above this: two-shot (world 2, 4, 8)
_TWO_SHOT_WORLDS = (2, 4, 8)


def _group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


_buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def symmetric_buffer(numel: int, dtype: torch.dtype, device: torch.device, group_name: str) -> torch.Tensor:
    """The front ``numel`` elements of this process's persistent symmetric buffer for (group,
    dtype, device), grown (doubling; a collective: every rank grows at the same call, as the
    all-reduce sizes agree) when too small. Reused by every call: stream order and the
    kernels' closing barrier keep one call's reads before the next call's copy."""
    key = (group_name, dtype, device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        import torch.distributed._symmetric_memory as symm_mem

        capacity = max(numel, 2 * (0 if buf is None else buf.numel()), 1 << 16)
        buf = symm_mem.empty(capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        _buffers[key] = buf
    return buf[:numel]


@torch.library.custom_op("recpipe::symm_all_reduce", mutates_args=(), device_types="cuda")
def symm_all_reduce(input: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``input`` (symmetric memory, contiguous) over the group: one-shot kernel."""
    return torch.ops.symm_mem.one_shot_all_reduce(input, "sum", group_name)


@torch.library.custom_op("recpipe::symm_all_reduce_copy", mutates_args=(), device_types="cuda")
def symm_all_reduce_copy(input: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``input`` (any memory) over the group, through the persistent buffer."""
    buf = symmetric_buffer(input.numel(), input.dtype, input.device, group_name)
    buf.copy_(input.reshape(-1))
    nbytes = input.numel() * input.element_size()
    if nbytes > ONE_SHOT_MAX_BYTES and _group_size(group_name) in _TWO_SHOT_WORLDS:
        out = torch.empty_like(input, memory_format=torch.contiguous_format)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", group_name, out.view(-1))
        return out
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name).view(input.shape)


@symm_all_reduce.register_fake
def _(input: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(input)


@symm_all_reduce_copy.register_fake
def _(input: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def one_shot_in_place(nbytes: int, group_name: str) -> bool:
    """Whether a computed input of ``nbytes`` is reduced in place, one-shot, rather than copied
    and reduced two-shot. One-shot reads every peer's whole buffer: (w-1)·n bytes per rank over
    NVLink; two-shot reads 2(w-1)/w·n. At 2 ranks that is the same, so the copy never pays; at
    4 and 8 ranks (where the copy path runs two-shot) above ``ONE_SHOT_MAX_BYTES`` the local
    copy (device memory bandwidth) costs less than the extra NVLink reads."""
    if nbytes <= ONE_SHOT_MAX_BYTES:
        return True
    world = _group_size(group_name)
    return world < 4 or world not in _TWO_SHOT_WORLDS  # the copy path's two-shot: 2, 4, 8


def _register_lowering() -> None:
    """Inductor: realize a computed input of ``symm_all_reduce`` in symmetric memory (no copy),
    else call ``symm_all_reduce_copy`` (see the module docstring)."""
    from torch._inductor import comm_lowering, ir
    from torch._inductor.lowering import register_lowering
    from torch._inductor.utils import sympy_product
    from torch.utils import _pytree as pytree

    @register_lowering(torch.ops.recpipe.symm_all_reduce.default, type_promotion_kind=None)
    def _lower(inp: Any, group_name: str) -> Any:
        op = torch.ops.recpipe.symm_all_reduce_copy.default
        nbytes = int(sympy_product(inp.get_size())) * inp.get_dtype().itemsize
        if one_shot_in_place(nbytes, group_name) and comm_lowering.can_realize_as_comm_buffer(
            inp, ir.CommBufferType.SYMM_MEM
        ):
            comm_lowering.realize_as_comm_buffer(inp, ir.CommBufferType.SYMM_MEM, group_name)
            op = torch.ops.recpipe.symm_all_reduce.default
        return pytree.tree_map(ir.TensorBox.create, ir.FallbackKernel.create(op, inp, group_name))


_register_lowering()


def uses_symmetric_memory(x: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether :func:`all_reduce_sum` reduces ``x`` through symmetric memory."""
    return _symmetric_ok(x.numel() * x.element_size(), x.dtype, x.device.type, group.group_name)


@torch.compiler.assume_constant_result
def _symmetric_ok(nbytes: int, dtype: torch.dtype, device_type: str, group_name: str) -> bool:
    """Host-side facts only: under torch.compile, a constant of the graph."""
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    if not (device_type == "cuda" and dtype in SYMM_DTYPES and 0 < nbytes <= SYMM_MAX_BYTES
            and nbytes % 4 == 0):  # the kernels move at least 4-byte words
        return False
    group = dist.distributed_c10d._resolve_process_group(group_name)
    one_host = group.size() <= int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    return (
        one_host
        and "nccl" in str(dist.get_backend(group))  # "nccl", or "cpu:gloo,cuda:nccl"
        and is_symm_mem_enabled_for_group(group_name)
    )


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, as a new tensor. Runs on the current stream;
    every rank must call it with the same shape and dtype. Traceable (``fullgraph=True``)."""
    if not uses_symmetric_memory(x, group):
        return funcol.all_reduce(x, "sum", group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.recpipe.symm_all_reduce(x, group.group_name)  # lowered: see above
    return torch.ops.recpipe.symm_all_reduce_copy(x, group.group_name)


@contextmanager
def _system_random_alloc_ids() -> Iterator[None]:
    from torch._inductor.codegen import wrapper

    saved = wrapper.random
    wrapper.random = random.SystemRandom()
    try:
        yield
    finally:
        wrapper.random = saved


def compile_symmetric(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` for graphs with symmetric buffers:
    unique buffer ids per graph (``SystemRandom``), no FX graph cache. One compiled function
    per input shape keeps each graph static (compile one per bucket)."""
    compiled = torch.compile(
        fn, fullgraph=True, dynamic=False,
        options={"fx_graph_cache": False, "autotune_local_cache": False},
    )

    def call(*args: Any, **kwargs: Any) -> Any:
        with _system_random_alloc_ids():
            return compiled(*args, **kwargs)

    return call
