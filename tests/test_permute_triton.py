"""The Triton kernels of the CUDA path, run on CPU tensors under ``TRITON_INTERPRET=1``.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so this module needs it set before
``recpipe.ops`` is imported; ``scripts/test.sh`` runs it in its own pytest process that way.
On a GPU machine (without the variable) the same checks run on CUDA tensors.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from permute_cases import fbgemm_reference, make_case
from triton.compiler import CompiledKernel

from recpipe.ops import permute_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)


@pytest.fixture(params=["fused", "offsets"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force one of the two ways the copy kernel finds its row starts."""
    monkeypatch.setattr(permute_triton, "FUSED_MAX_ROWS", 1 << 62 if request.param == "fused" else -1)
    return request.param


GUARD = 16  # poisoned elements on both sides of each output


def _guarded(size: int, like: torch.Tensor | None) -> torch.Tensor | None:
    if like is None:
        return None
    return torch.full((size + 2 * GUARD,), -3, dtype=like.dtype, device=like.device)


def _run(case, n: int):
    """The kernels' outputs and status; asserts that nothing was written next to the outputs."""
    T_out, B = case.permute.numel(), case.lengths.shape[1]
    bufs = [_guarded(T_out * B, case.lengths), _guarded(n, case.values), _guarded(n, case.weights)]
    lo, vo, wo = (None if b is None else b[GUARD:-GUARD] for b in bufs)
    lo = lo.view(T_out, B)
    status = permute_triton.permute_into(*case.args(), n, lo, vo, wo)
    for b in bufs:
        assert b is None or ((b[:GUARD] == -3).all() and (b[-GUARD:] == -3).all())
    return (lo, vo, wo), 1 if status is None else int(status.item())  # None: nothing to do


@pytest.mark.parametrize(
    "T, B, T_out",
    [(1, 1, 1), (7, 3, 4), (40, 1, 55), (3, 0, 2), (0, 4, 0), (5, 300, 9), (1100, 2, 1030)],
)
@pytest.mark.parametrize("weights_dtype", [None, torch.float16, torch.float32])
def test_kernels_match_fbgemm(T: int, B: int, T_out: int, weights_dtype, mode: str) -> None:
    case = make_case(T, B, T_out, weights_dtype=weights_dtype, max_len=9, seed=T + B).to(DEVICE)
    ref = fbgemm_reference(case)
    got, status = _run(case, int(ref[0].sum()))
    assert status == 1
    for g, r in zip(got, ref):
        assert (g is None) == (r is None)
        if r is not None:
            assert torch.equal(g.cpu(), r)


def test_long_rows_use_several_programs(mode: str) -> None:
    """Rows longer than one copy block are split across programs and loop."""
    case = make_case(3, 2, 4, max_len=9000, weights_dtype=None, seed=11).to(DEVICE)
    ref = fbgemm_reference(case)
    got, status = _run(case, int(ref[0].sum()))
    assert status == 1 and torch.equal(got[1].cpu(), ref[1])


@pytest.mark.parametrize("what", ["permute", "sum", "values", "negative length", "negative row"])
def test_bad_input_flags_status_and_stays_in_bounds(what: str, mode: str) -> None:
    case = make_case(6, 3, 5, max_len=4, seed=12).to(DEVICE)
    n = int(fbgemm_reference(case)[0].sum())
    row = int(case.permute[1])
    if what == "permute":
        case.permute[1] = 6
    elif what == "sum":
        n -= 1
    elif what == "values":
        case.values = case.values[:-1]
    elif what == "negative length":  # the row sum, and so every start and total, stays the same
        case.lengths[row, 0] += case.lengths[row, 1] + 1
        case.lengths[row, 1] = -1
    else:  # a negative row sum, counted as empty: the next rows still start at >= 0
        case.lengths[int(case.permute[0])] = 0
        case.lengths[row] = torch.tensor([0, -20, 0])
    (lo, vo, _), status = _run(case, max(n, 0))
    assert status == 0
    if what == "permute":  # the bad row is written as empty
        assert (lo[1] == 0).all()


@pytest.fixture
def launch_cache(monkeypatch: pytest.MonkeyPatch) -> dict:
    """An empty cache of compiled kernels for the test (see permute_triton._launch)."""
    cache: dict = {}
    monkeypatch.setattr(permute_triton, "_COMPILED", cache)
    return cache


def test_cached_launches_follow_alignment(launch_cache: dict) -> None:
    """Aligned inputs, then views 1 element into their buffer (8 and 4 bytes: not 16-byte
    aligned), each twice: on CUDA the second call of each goes through the cached launcher of
    the kernel compiled for its alignment."""
    case = make_case(9, 5, 12, seed=13).to(DEVICE)
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())
    for offset in (0, 0, 1, 1):
        for name in ("values", "weights"):
            t = getattr(case, name)
            buf = torch.empty(1 + t.numel(), dtype=t.dtype, device=t.device)
            setattr(case, name, buf[offset : offset + t.numel()].copy_(t))
        got, status = _run(case, n)
        assert status == 1
        for g, r in zip(got, ref):
            assert torch.equal(g.cpu(), r)
    copies = [key for key in launch_cache if key[0] is permute_triton._copy_kernel]
    assert len(copies) == (0 if INTERPRET else 2)  # the interpreter: always the JIT launch


class _FakeCompiled(CompiledKernel):
    """Stands in for a compiled kernel: records the launches through its cached launcher."""

    def __init__(self, num_params: int) -> None:
        self.module = None
        self.src = SimpleNamespace(signature=dict.fromkeys(range(num_params)))
        self.launches: list = []

    def __getitem__(self, grid):
        return lambda *args, stream: self.launches.append((grid, args, stream))


class _FakeKernel:
    """Stands in for a JITFunction: each JIT launch returns a new _FakeCompiled."""

    def __init__(self) -> None:
        self.compiled: list[_FakeCompiled] = []

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.compiled.append(_FakeCompiled(len(args)))
            return self.compiled[-1]

        return run


def test_launch_cache_keys_everything_triton_specializes_on(launch_cache: dict) -> None:
    kernel = _FakeKernel()
    buf = torch.zeros(8, dtype=torch.int64)
    base = dict(ptr=buf, size=100, block=4, warps=4, device=(0, 7))

    def launch(**change) -> None:
        a = {**base, **change}
        args = (a["device"], (a["ptr"],), (a["size"],), (a["block"],), a["warps"])
        permute_triton._launch(kernel, (2, 1, 1), *args)

    new_keys = [
        {}, dict(ptr=buf[1:]), dict(ptr=buf.float()), dict(size=2**31), dict(size=1),
        dict(size=32), dict(block=8), dict(warps=8), dict(device=(1, 7)),
    ]
    for change in new_keys:
        launch(**change)
    assert len(kernel.compiled) == len(new_keys)
    assert not any(c.launches for c in kernel.compiled)
    launch(size=101)  # the same kind of size as 100: the first kernel, cached
    launch(ptr=buf[3:], device=(0, 9))  # misaligned again (24 bytes): the second, on stream 9
    assert len(kernel.compiled) == len(new_keys)
    [(grid, (ptr, *rest), stream)] = kernel.compiled[0].launches
    assert grid == (2, 1, 1) and ptr is buf and rest == [101, 4] and stream == 7
    [(_, (ptr, *_), stream)] = kernel.compiled[1].launches
    assert ptr.data_ptr() == buf.data_ptr() + 24 and stream == 9
    launch(device=None)  # CPU tensors (the interpreter): always the JIT launch, never cached
    launch(device=None)
    assert len(kernel.compiled) == len(new_keys) + 2 and len(launch_cache) == len(new_keys)
