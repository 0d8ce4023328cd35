"""Sum all-reduce for dense-gradient buckets: NCCL, or symmetric memory (one-shot or two-shot) in
a group on one NVLink host, whichever was measured fastest; gloo on CPU; traceable by
``torch.compile``, with no extra copy for a bucket's flat gradient.

    from recpipe.ops.all_reduce import all_reduce_flat, all_reduce_sum
    total = all_reduce_sum(x, group)        # a new tensor: the sum of x over the group's ranks
    flat = all_reduce_flat([a, b], group)   # the sum of cat([a.view(-1), b.view(-1)]): 1-D

The algorithm is chosen on the host, per call, from the bytes, dtype, device and group
(:func:`choose_algorithm`); the ``algorithm`` argument asks for

- ``"auto"`` (default): the measured table of :mod:`recpipe.ops.all_reduce_table` (a
  symmetric algorithm only where the 95% interval of its latency ratio to NCCL shows a win at
  the measured sizes around the bucket's);
- ``"symm_mem"``: symmetric memory wherever it can run, one-shot up to ``ONE_SHOT_MAX_BYTES``,
  two-shot above (at 2, 4 and 8 ranks), NCCL above ``SYMM_MAX_BYTES``;
- ``"nccl"``, ``"one_shot"`` or ``"two_shot"``: that algorithm.

Symmetric memory can run on CUDA, for fp32/bf16 all-reduces of a multiple of 4 bytes, in an
NCCL group that has symmetric memory enabled (``enable_symm_mem_for_group``: whoever enables
it vouches that the group is on one host, as ``recpipe.pipeline`` does); anything else is NCCL
(gloo on CPU): c10d's ``all_reduce`` on a copy when called eagerly, ``funcol.all_reduce`` when
traced. The symmetric path is two custom ops:

- ``recpipe::symm_all_reduce(Tensor input, str group_name) -> Tensor``: ``input`` must be 1-D
  symmetric memory; the one-shot kernel (every rank reads every peer's buffer; ``input`` is
  left intact) writes the sum to a new tensor.
- ``recpipe::symm_all_reduce_copy(Tensor[] inputs, str group_name, str algorithm) -> Tensor``:
  1-D inputs in any memory, concatenated into this process's persistent symmetric buffer for
  (group, dtype, device) by one ``cat(out=)`` (one input: a ``copy_``, a device-to-device
  memcpy on the copy engine); then one-shot or two-shot (which uses its input as scratch: only
  a private buffer allows that).

Under ``torch.compile`` (importing this module registers the inductor lowering; the same code
on torch 2.11 and 2.13), two-shot runs ``symm_all_reduce_copy`` on the flattened inputs, and
one-shot ``symm_all_reduce`` on their ``cat``, lowered to:

1. the ``cat`` is computed in the graph with a static shape: its kernel writes straight into a
   symmetric buffer (inductor's ``empty_strided_p2p``), reduced in place, no copy;
2. otherwise (one graph input: inductor drops a ``cat`` of one tensor; or a buffer inductor does
   not allocate itself): ``symm_all_reduce_copy`` of it, one DMA copy.

Eager calls take ``symm_all_reduce_copy`` (a ``cat`` of several inputs costs no extra copy
there). Compile with inductor (another backend would pass ordinary memory to
``symm_all_reduce``), through :func:`compile_symmetric`: inductor names each
symmetric buffer with an id drawn from Python's ``random``, which dynamo reseeds per frame, so
two graphs would get the same id (and the allocator refuses a second live buffer or a new size
under one id); it draws them from ``SystemRandom`` instead and keeps these graphs out of the FX
graph cache. No CUDA graphs, no multicast (one- and two-shot read peers' buffers directly).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from recpipe.ops.all_reduce_table import ALGORITHMS, LatencyTable, load_table, local_machine

SYMM_DTYPES = (torch.float32, torch.bfloat16)  # the kernels' dtypes (sum only)
SYMM_MAX_BYTES = 16 << 20  # "symm_mem": NCCL above
ONE_SHOT_MAX_BYTES = 1 << 20  # "symm_mem": two-shot above (world 2, 4, 8)
_TWO_SHOT_WORLDS = (2, 4, 8)
POLICIES = ("auto", "symm_mem", "nccl")  # the requests that choose by size
REQUESTS = POLICIES + ALGORITHMS[1:]  # every value of ``algorithm``


def _group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


_buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def symmetric_buffer(numel: int, dtype: torch.dtype, device: torch.device, group_name: str) -> torch.Tensor:
    """The front ``numel`` elements of this process's persistent symmetric buffer for (group,
    dtype, device), grown (doubling; a collective: every rank grows at the same call, as the
    all-reduce sizes agree) when too small. Reused by every call, so all calls go on one
    stream (in training, the communication stream of ``recpipe.pipeline.data_parallel``):
    stream order and the kernels' closing barrier keep one call's reads before the next call's
    copy."""
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
    """Sum of ``input`` (1-D, symmetric memory, contiguous) over the group: one-shot kernel."""
    return torch.ops.symm_mem.one_shot_all_reduce(input, "sum", group_name)


@torch.library.custom_op("recpipe::symm_all_reduce_copy", mutates_args=(), device_types="cuda")
def symm_all_reduce_copy(inputs: list[torch.Tensor], group_name: str, algorithm: str) -> torch.Tensor:
    """Sum over the group of the 1-D ``inputs`` (any memory, one dtype) concatenated, through the
    persistent buffer: ``algorithm`` is ``"one_shot"`` or ``"two_shot"``."""
    numel = sum(t.numel() for t in inputs)
    buf = symmetric_buffer(numel, inputs[0].dtype, inputs[0].device, group_name)
    if len(inputs) == 1:
        buf.copy_(inputs[0])
    else:
        torch.cat(inputs, out=buf)
    if algorithm == "two_shot":
        out = torch.empty_like(buf)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", group_name, out)
        return out
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)


@symm_all_reduce.register_fake
def _(input: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(input)


@symm_all_reduce_copy.register_fake
def _(inputs: list[torch.Tensor], group_name: str, algorithm: str) -> torch.Tensor:
    return inputs[0].new_empty(sum(t.numel() for t in inputs))


def _register_lowering() -> None:
    """Inductor: realize a computed input of ``symm_all_reduce`` in symmetric memory (no copy),
    else call ``symm_all_reduce_copy`` on it, one-shot (see the module docstring)."""
    from torch._inductor import comm_lowering, ir
    from torch._inductor.lowering import register_lowering
    from torch.utils import _pytree as pytree

    @register_lowering(torch.ops.recpipe.symm_all_reduce.default, type_promotion_kind=None)
    def _lower(inp: Any, group_name: str) -> Any:
        if comm_lowering.can_realize_as_comm_buffer(inp, ir.CommBufferType.SYMM_MEM):
            comm_lowering.realize_as_comm_buffer(inp, ir.CommBufferType.SYMM_MEM, group_name)
            op, args = torch.ops.recpipe.symm_all_reduce.default, (inp, group_name)
        else:
            op, args = torch.ops.recpipe.symm_all_reduce_copy.default, ([inp], group_name, "one_shot")
        return pytree.tree_map(ir.TensorBox.create, ir.FallbackKernel.create(op, *args))


_register_lowering()


def _symmetric_group(dtype: torch.dtype, device_type: str, group_name: str) -> bool:
    """Whether symmetric memory can reduce ``dtype`` on ``device_type`` in the group: an NCCL
    group with symmetric memory enabled (node-locality is the enabler's to check)."""
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    if device_type != "cuda" or dtype not in SYMM_DTYPES:
        return False
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return "nccl" in str(dist.get_backend(group)) and is_symm_mem_enabled_for_group(group_name)


def _table(world: int) -> LatencyTable | None:
    return load_table(local_machine(world))


def choose_algorithm(
    nbytes: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup, algorithm: str = "auto",
) -> str:
    """The algorithm (``"nccl"``, ``"one_shot"`` or ``"two_shot"``) that
    :func:`all_reduce_flat` runs for ``nbytes`` of ``dtype`` on ``device`` in ``group`` when
    asked for ``algorithm`` (one of ``REQUESTS``: see the module docstring)."""
    return _choose(nbytes, dtype, device.type, group.group_name, algorithm)


@torch.compiler.assume_constant_result
def _choose(nbytes: int, dtype: torch.dtype, device_type: str, group_name: str, algorithm: str) -> str:
    """Host-side facts only: under torch.compile, a constant of the graph."""
    if algorithm not in REQUESTS:
        raise ValueError(f"all-reduce algorithm {algorithm!r}: expected one of {REQUESTS}")
    words = nbytes > 0 and nbytes % 4 == 0  # the kernels move 4-byte words
    if algorithm == "nccl" or not (words and _symmetric_group(dtype, device_type, group_name)):
        return "nccl"
    world = _group_size(group_name)
    if algorithm == "auto":
        table = _table(world)
        return "nccl" if table is None else table.choose(nbytes, dtype)
    if algorithm == "symm_mem":
        if nbytes > SYMM_MAX_BYTES:
            return "nccl"
        return "two_shot" if nbytes > ONE_SHOT_MAX_BYTES and world in _TWO_SHOT_WORLDS else "one_shot"
    return algorithm


def symmetric_max_bytes(
    dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup, algorithm: str = "auto",
) -> int:
    """The largest all-reduce of ``dtype`` on ``device``, in bytes, that ``algorithm`` (one of
    ``POLICIES``) runs through symmetric memory in ``group``; 0 if none."""
    if algorithm not in POLICIES:
        raise ValueError(f"all-reduce policy {algorithm!r}: expected one of {POLICIES}")
    if algorithm == "nccl" or not _symmetric_group(dtype, device.type, group.group_name):
        return 0
    if algorithm == "symm_mem":
        return SYMM_MAX_BYTES
    table = _table(group.size())
    return 0 if table is None else table.largest_symmetric(dtype)


def all_reduce_flat(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, algorithm: str = "auto",
) -> torch.Tensor:
    """The sum over ``group``'s ranks of the flattened ``tensors`` (one dtype and device),
    concatenated: a new 1-D tensor. ``algorithm``: one of ``REQUESTS``. Runs on the current
    stream; every rank must call it with the same shapes and dtype. Traceable
    (``fullgraph=True``)."""
    eager = not torch.compiler.is_compiling()
    if algorithm == "nccl" and eager:  # (a bucket's choice, made once: no per-call Python)
        return _c10d_sum(tensors, group)
    flat = [t.reshape(-1) for t in tensors]
    nbytes = sum(t.numel() for t in flat) * flat[0].element_size()
    chosen = _choose(nbytes, flat[0].dtype, flat[0].device.type, group.group_name, algorithm)
    if chosen == "two_shot" or (chosen == "one_shot" and eager):
        return torch.ops.recpipe.symm_all_reduce_copy(flat, group.group_name, chosen)
    if chosen == "nccl" and eager:
        return _c10d_sum(flat, group)
    whole = flat[0] if len(flat) == 1 else torch.cat(flat)
    if chosen == "nccl":
        return funcol.all_reduce(whole, "sum", group)
    return torch.ops.recpipe.symm_all_reduce(whole, group.group_name)  # compiled one-shot: lowered


def _c10d_sum(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Eager NCCL (gloo on CPU): c10d's in-place all-reduce on a flat copy of ``tensors``. A
    functional collective's wrapper tensor and its wait cost the host several times more per
    call."""
    whole = torch.cat([t.reshape(-1) for t in tensors])  # (a copy, even of one tensor)
    dist.all_reduce(whole, group=group)
    return whole


def symmetric_mean_(flat: torch.Tensor, group: dist.ProcessGroup, algorithm: str) -> torch.Tensor:
    """``flat`` (1-D, contiguous, CUDA, one of ``SYMM_DTYPES``, in a group with symmetric memory)
    becomes its mean over ``group``'s ranks, in place, on the current stream: divided by the
    world size as it is copied into this process's persistent symmetric buffer (before the sum,
    as DDP divides), then summed by ``algorithm`` (``"one_shot"`` or ``"two_shot"``) back into
    ``flat``. Eager only (a DDP bucket's reduction)."""
    buf = symmetric_buffer(flat.numel(), flat.dtype, flat.device, group.group_name)
    torch.div(flat, group.size(), out=buf)
    if algorithm == "two_shot":
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", group.group_name, flat)
    else:  # (one-shot buckets are small: its copy back costs little)
        flat.copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name))
    return flat


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, algorithm: str = "auto") -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, as a new tensor of ``x``'s shape: see
    :func:`all_reduce_flat`."""
    return all_reduce_flat([x], group, algorithm).view(x.shape)


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
