"""recpipe.ops.all_reduce: numerics of every path, and where the symmetric buffers come from.

CPU (CI): 2 gloo ranks, the functional-collective path, eager and compiled. 2+ GPUs: NCCL
ranks with symmetric memory: results equal NCCL's; the generated code reduces a computed input
in the symmetric buffer its producer wrote (no copy) and a graph input through the persistent
buffer (``symm_all_reduce_copy``).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch._subclasses.fake_tensor import FakeTensorMode

from recpipe.ops import all_reduce
from recpipe.ops.all_reduce import (
    ONE_SHOT_MAX_BYTES,
    SYMM_MAX_BYTES,
    all_reduce_sum,
    compile_symmetric,
    uses_symmetric_memory,
)

GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _sums(rank: int, world: int, device: torch.device) -> list[bool]:
    group = dist.group.WORLD
    x = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)
    expected = torch.arange(1000, dtype=torch.float32, device=device) * sum(range(1, world + 1))
    eager = all_reduce_sum(x, group)
    compiled = compile_symmetric(lambda a: all_reduce_sum(a * 2, group) / 2)(x)
    return [
        not uses_symmetric_memory(x, group),
        torch.equal(torch.as_tensor(eager), expected),
        torch.equal(compiled, expected),
        torch.equal(x, torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)),
    ]


@pytest.mark.skipif(GPU2, reason="the gloo path; GPUs take the symmetric one")
def test_gloo_sums_eager_and_compiled() -> None:
    assert run_ranks(2, _sums) == [[True] * 4] * 2


def test_fake_impls_keep_shape_and_dtype() -> None:
    with FakeTensorMode():
        x = torch.empty(3, 5, dtype=torch.bfloat16)
        for op in (torch.ops.recpipe.symm_all_reduce, torch.ops.recpipe.symm_all_reduce_copy):
            y = op(x, "0")
            assert y.shape == x.shape and y.dtype == x.dtype


def test_lowering_reduces_computed_inputs_in_place_and_copies_graph_inputs(monkeypatch) -> None:
    """The lowering's choice, on CPU: CPU kernels stand in for the CUDA ones and the layout
    change is recorded instead of made (inductor allocates symmetric buffers on CUDA only)."""
    from torch._inductor import comm_lowering
    from torch._inductor.utils import run_and_get_code

    realized = []
    monkeypatch.setattr(comm_lowering, "realize_as_comm_buffer",
                        lambda x, kind, group: realized.append((x.get_name(), group)))
    lib = torch.library.Library("recpipe", "IMPL")  # test-only CPU kernels, dropped at the end
    try:
        for name in ("symm_all_reduce", "symm_all_reduce_copy"):
            lib.impl(name, lambda x, group: 2 * x, "CPU")
        a, b = torch.randn(6), torch.randn(10)
        computed = compile_symmetric(lambda a, b: torch.ops.recpipe.symm_all_reduce(torch.cat([a * 2, b]), "g"))
        out, (code,) = run_and_get_code(computed, a, b)
        torch.testing.assert_close(out, 2 * torch.cat([a * 2, b]))
        direct = re.findall(r"recpipe\.symm_all_reduce\.default\((\w+)", code)
        assert [name for name, _ in realized] == direct and realized[0][1] == "g", code
        assert "symm_all_reduce_copy" not in code
        realized.clear()
        graph_input = compile_symmetric(lambda x: torch.ops.recpipe.symm_all_reduce(x, "g"))
        out, (code,) = run_and_get_code(graph_input, a)
        torch.testing.assert_close(out, 2 * a)
        assert "recpipe.symm_all_reduce_copy.default(arg" in code and not realized, code
        # Above ONE_SHOT_MAX_BYTES: in place at 2 ranks (and 6: no two-shot there); copied for
        # two-shot at 4 and 8.
        big = torch.randn(ONE_SHOT_MAX_BYTES // 8 + 8)  # fp32, the cat of two: > 1 MiB
        for world, in_place in ((2, True), (4, False), (6, True), (8, False)):
            realized.clear()
            monkeypatch.setattr(all_reduce, "_group_size", lambda name, w=world: w)
            fn = compile_symmetric(lambda x: torch.ops.recpipe.symm_all_reduce(torch.cat([x * 2, x]), "g"))
            out, (code,) = run_and_get_code(fn, big)
            torch.testing.assert_close(out, 2 * torch.cat([big * 2, big]))
            assert bool(realized) == in_place, (world, code)
            assert ("symm_all_reduce_copy" in code) != in_place, (world, code)
    finally:
        lib._destroy()


def _p2p_reads(code: str) -> tuple[set[str], list[str], list[str]]:
    """Buffers allocated symmetric, and the first argument of each recpipe op call."""
    p2p = set(re.findall(r"(\w+) = empty_strided_p2p\(", code))
    direct = re.findall(r"recpipe\.symm_all_reduce\.default\((\w+)", code)
    copied = re.findall(r"recpipe\.symm_all_reduce_copy\.default\((\w+)", code)
    return p2p, direct, copied


def _gpu_paths(rank: int, world: int, device: torch.device) -> None:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group = dist.group.WORLD
    enable_symm_mem_for_group(group.group_name)
    torch._dynamo.config.recompile_limit = 64  # one graph per (dtype, size) of each lambda
    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        # one-shot; the copy path's two-shot (eager); beyond SYMM_MAX_BYTES: NCCL
        for nbytes in (4096, 2 * ONE_SHOT_MAX_BYTES, SYMM_MAX_BYTES, 2 * SYMM_MAX_BYTES):
            x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            assert uses_symmetric_memory(x, group) == (nbytes <= SYMM_MAX_BYTES)
            torch.testing.assert_close(torch.as_tensor(all_reduce_sum(x, group)), ref)
            a, b = x.chunk(2)
            fn = compile_symmetric(lambda a, b: all_reduce_sum(torch.cat([a * 2, b]), group))
            out, (code,) = run_and_get_code(fn, a, b)
            ref2 = torch.cat([a * 2, b])
            dist.all_reduce(ref2, group=group)
            torch.testing.assert_close(out, ref2)
            p2p, direct, copied = _p2p_reads(code)
            if nbytes <= SYMM_MAX_BYTES:  # computed input: reduced where its producer wrote it
                assert direct and set(direct) <= p2p and not copied, code
            else:
                assert not direct and not copied and not p2p, code
        x = torch.randn(1024, device=device).to(dtype)
        out, (code,) = run_and_get_code(compile_symmetric(lambda t: all_reduce_sum(t, group)), x)
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        torch.testing.assert_close(out, ref)
        p2p, direct, copied = _p2p_reads(code)  # graph input: the persistent buffer + copy_
        assert copied and not direct and not p2p, code


@pytest.mark.skipif(not GPU2, reason="needs 2 GPUs")
def test_gpu_symmetric_paths_match_nccl_and_copy_only_graph_inputs() -> None:
    run_ranks(2, _gpu_paths)
