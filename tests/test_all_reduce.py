"""recpipe.ops.all_reduce: numerics of every path, the host-side choice, and where the symmetric
buffers come from.

CPU (CI): 2 gloo ranks, the NCCL path (gloo), eager (c10d) and compiled (functional collectives); the choice on fake
groups and tables; the lowering with CPU stand-ins for the kernels. 2+ GPUs: NCCL ranks with
symmetric memory: results equal NCCL's; the generated code reduces a computed one-shot input in
the symmetric buffer its producer wrote (no copy), and a graph input or a two-shot input through
the persistent buffer (``symm_all_reduce_copy``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from group_fixtures import local_group_fixture, symmetric_h200_fixture  # noqa: F401 (fixtures)
from torch._subclasses.fake_tensor import FakeTensorMode

from recpipe.ops import all_reduce
from recpipe.ops.all_reduce import (
    ONE_SHOT_MAX_BYTES,
    REQUESTS,
    SYMM_MAX_BYTES,
    all_reduce_flat,
    all_reduce_sum,
    choose_algorithm,
    compile_symmetric,
    symmetric_max_bytes,
)

GPU2 = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _sums(rank: int, world: int, device: torch.device) -> list[bool]:
    group = dist.group.WORLD
    x = torch.arange(1000, dtype=torch.float32, device=device).view(10, 100) * (rank + 1)
    expected = torch.arange(1000, dtype=torch.float32, device=device).view(10, 100) * sum(range(1, world + 1))
    eager = all_reduce_sum(x, group)
    compiled = compile_symmetric(lambda a: all_reduce_sum(a * 2, group) / 2)(x)
    flat = compile_symmetric(lambda a: all_reduce_flat([a[:3], a[3:].t()], group))(x)
    eager_flat = all_reduce_flat([x[:3], x[3:].t()], group)
    expected_flat = torch.cat([expected[:3].reshape(-1), expected[3:].t().reshape(-1)])
    return [
        all(choose_algorithm(x.numel() * 4, x.dtype, device, group, r) == "nccl" for r in REQUESTS),
        torch.equal(torch.as_tensor(eager), expected),
        torch.equal(compiled, expected),
        torch.equal(flat, expected_flat),
        torch.equal(eager_flat, expected_flat),
        torch.equal(x, torch.arange(1000, dtype=torch.float32, device=device).view(10, 100) * (rank + 1)),
    ]


@pytest.mark.skipif(GPU2, reason="the gloo path; GPUs take the symmetric one")
def test_gloo_sums_eager_and_compiled() -> None:
    assert run_ranks(2, _sums) == [[True] * 6] * 2


def _choose(nbytes: int, algorithm: str, dtype: torch.dtype = torch.bfloat16) -> str:
    return all_reduce._choose(nbytes, dtype, "cuda", "g", algorithm)


@pytest.mark.usefixtures("symmetric_h200")
def test_choice_per_request() -> None:
    K, M = 1 << 10, 1 << 20
    sizes = [4 * K, M, 2 * M, 16 * M, 32 * M]
    assert [_choose(n, "auto") for n in sizes] == ["nccl", "nccl", "two_shot", "two_shot", "nccl"]
    assert [_choose(n, "symm_mem") for n in sizes] == ["one_shot", "one_shot", "two_shot", "two_shot", "nccl"]
    for forced in ("nccl", "one_shot", "two_shot"):
        assert [_choose(n, forced) for n in sizes] == [forced] * len(sizes)
    assert _choose(2 * M + 2, "two_shot") == "nccl"  # the kernels move 4-byte words
    with pytest.raises(ValueError, match="'fast'"):
        _choose(4 * K, "fast")


def test_choice_without_symmetric_memory_or_table(monkeypatch: pytest.MonkeyPatch) -> None:
    symmetric = True
    monkeypatch.setattr(all_reduce, "_symmetric_group", lambda dtype, device_type, name: symmetric)
    monkeypatch.setattr(all_reduce, "_group_size", lambda name: 2)
    monkeypatch.setattr(all_reduce, "_table", lambda world: None)
    assert _choose(1 << 21, "auto") == "nccl" and _choose(1 << 21, "symm_mem") == "two_shot"
    symmetric = False
    assert all(_choose(1 << 21, r) == "nccl" for r in REQUESTS)


def test_symmetric_memory_needs_cuda_fp32_bf16_nccl_and_enabled_group(
    local_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only what the group's owner enabled: no guess from LOCAL_WORLD_SIZE (1 rank, 0 per node)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = local_group.group_name
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda group_name: group_name == name)
    assert not all_reduce._symmetric_group(torch.float32, "cuda", name)  # gloo
    monkeypatch.setattr(dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
    assert all_reduce._symmetric_group(torch.float32, "cuda", name)
    assert all_reduce._symmetric_group(torch.bfloat16, "cuda", name)
    assert not all_reduce._symmetric_group(torch.float16, "cuda", name)
    assert not all_reduce._symmetric_group(torch.float32, "cpu", name)
    monkeypatch.setattr(symm_mem, "is_symm_mem_enabled_for_group", lambda group_name: False)
    assert not all_reduce._symmetric_group(torch.float32, "cuda", name)


@pytest.mark.usefixtures("symmetric_h200")
def test_symmetric_max_bytes_is_the_largest_winning_bucket() -> None:
    group = SimpleNamespace(group_name="g", size=lambda: 2)  # never resolved: see the fixture
    cuda = torch.device("cuda")
    assert symmetric_max_bytes(torch.bfloat16, cuda, group, "auto") == 16 << 20
    assert symmetric_max_bytes(torch.bfloat16, cuda, group, "symm_mem") == SYMM_MAX_BYTES
    assert symmetric_max_bytes(torch.bfloat16, cuda, group, "nccl") == 0
    with pytest.raises(ValueError, match="'one_shot'"):
        symmetric_max_bytes(torch.bfloat16, cuda, group, "one_shot")


def test_fake_impls_keep_dtype_and_concatenate() -> None:
    with FakeTensorMode():
        x, y = torch.empty(15, dtype=torch.bfloat16), torch.empty(4, dtype=torch.bfloat16)
        out = torch.ops.recpipe.symm_all_reduce(x, "0")
        assert out.shape == x.shape and out.dtype == x.dtype
        out = torch.ops.recpipe.symm_all_reduce_copy([x, y], "0", "two_shot")
        assert out.shape == (19,) and out.dtype == x.dtype


def test_lowering_follows_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled: one-shot reduces a computed input in place and copies a graph input; two-shot
    copies. On CPU: CPU kernels stand in for the CUDA ones (the copy op scales by 2 for one-shot,
    3 for two-shot), and the layout change is recorded instead of made (inductor allocates
    symmetric buffers on CUDA only)."""
    from torch._inductor import comm_lowering
    from torch._inductor.utils import run_and_get_code

    realized = []
    monkeypatch.setattr(comm_lowering, "realize_as_comm_buffer",
                        lambda x, kind, group: realized.append((x.get_name(), group)))
    chosen = "one_shot"
    monkeypatch.setattr(all_reduce, "_choose", lambda *args: chosen)
    group = SimpleNamespace(group_name="g")  # only its name is read on the symmetric paths
    lib = torch.library.Library("recpipe", "IMPL")  # test-only CPU kernels, dropped at the end
    try:
        lib.impl("symm_all_reduce", lambda x, group: 2 * x, "CPU")
        lib.impl("symm_all_reduce_copy",
                 lambda xs, group, algorithm: torch.cat(xs) * (2 if algorithm == "one_shot" else 3), "CPU")
        a, b = torch.randn(6), torch.randn(10)
        computed = compile_symmetric(lambda a, b: all_reduce_flat([a * 2, b], group))
        out, (code,) = run_and_get_code(computed, a, b)
        torch.testing.assert_close(out, 2 * torch.cat([a * 2, b]))
        p2p, direct, copied = _p2p_reads(code)
        assert [name for name, _ in realized] == direct and realized[0][1] == "g" and not copied, code
        realized.clear()
        graph_input = compile_symmetric(lambda x: all_reduce_sum(x, group))
        out, (code,) = run_and_get_code(graph_input, a.view(2, 3))
        torch.testing.assert_close(out, 2 * a.view(2, 3))
        p2p, direct, copied = _p2p_reads(code)
        assert copied == ["arg0_1"] and "'one_shot'" in code and not direct and not realized, code
        chosen = "two_shot"
        two_shot = compile_symmetric(lambda a, b: all_reduce_flat([a * 2, b], group))
        out, (code,) = run_and_get_code(two_shot, a, b)
        torch.testing.assert_close(out, 3 * torch.cat([a * 2, b]))
        p2p, direct, copied = _p2p_reads(code)
        assert copied and "'two_shot'" in code and not direct and not realized, code
    finally:
        lib._destroy()


def _p2p_reads(code: str) -> tuple[set[str], list[str], list[str]]:
    """Buffers allocated symmetric, and the first argument of each recpipe op call."""
    p2p = set(re.findall(r"(\w+) = empty_strided_p2p\(", code))
    direct = re.findall(r"recpipe\.symm_all_reduce\.default\((\w+)", code)
    copied = re.findall(r"recpipe\.symm_all_reduce_copy\.default\(\[(?:reinterpret_tensor\()?(\w+)", code)
    return p2p, direct, copied


def _gpu_paths(rank: int, world: int, device: torch.device) -> None:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group = dist.group.WORLD
    enable_symm_mem_for_group(group.group_name)
    torch._dynamo.config.recompile_limit = 64  # one graph per (dtype, size) of each lambda
    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        # one-shot; two-shot; beyond SYMM_MAX_BYTES: NCCL
        for nbytes in (4096, 2 * ONE_SHOT_MAX_BYTES, SYMM_MAX_BYTES, 2 * SYMM_MAX_BYTES):
            chosen = choose_algorithm(nbytes, dtype, device, group, "symm_mem")
            assert chosen == ("one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else
                              "two_shot" if nbytes <= SYMM_MAX_BYTES else "nccl"), (nbytes, chosen)
            x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            for algorithm in ("symm_mem", "auto", "one_shot", "two_shot"):
                torch.testing.assert_close(torch.as_tensor(all_reduce_sum(x, group, algorithm)), ref)
            a, b = x.chunk(2)
            fn = compile_symmetric(lambda a, b: all_reduce_flat([a * 2, b], group, "symm_mem"))
            out, (code,) = run_and_get_code(fn, a, b)
            ref2 = torch.cat([a * 2, b])
            dist.all_reduce(ref2, group=group)
            torch.testing.assert_close(out, ref2)
            p2p, direct, copied = _p2p_reads(code)
            if chosen == "one_shot":  # computed input: reduced where its producer wrote it
                assert direct and set(direct) <= p2p and not copied, code
            elif chosen == "two_shot":  # concatenated into the persistent buffer
                assert copied and not direct and not p2p, code
            else:
                assert not direct and not copied and not p2p, code
        x = torch.randn(1024, device=device).to(dtype)
        out, (code,) = run_and_get_code(compile_symmetric(lambda t: all_reduce_sum(t, group, "symm_mem")), x)
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        torch.testing.assert_close(out, ref)
        p2p, direct, copied = _p2p_reads(code)  # graph input: the persistent buffer + copy_
        assert copied and not direct and not p2p, code


@pytest.mark.skipif(not GPU2, reason="needs 2 GPUs")
def test_gpu_symmetric_paths_match_nccl_and_copy_only_graph_inputs() -> None:
    run_ranks(2, _gpu_paths)
