"""The Triton kernels of the CUDA path, run on CPU tensors under ``TRITON_INTERPRET=1``.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so this module needs it set before
``recpipe.ops`` is imported; ``scripts/test.sh`` runs it in its own pytest process that way.
On a GPU machine (without the variable) the same checks run on CUDA tensors.
"""

from __future__ import annotations

import os

import pytest
import torch
from permute_cases import fbgemm_reference, make_case

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
    status = permute_triton.permute_into(case.permute, case.lengths, case.values, case.weights, n, lo, vo, wo)
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
