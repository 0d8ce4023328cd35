"""recpipe::permute_2D_sparse_data: parity with fbgemm, zero-copy, errors, opcheck, compile."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from permute_cases import Case, fbgemm_reference, make_case

import recpipe.ops  # noqa: F401  (registers torch.ops.recpipe)
from recpipe.ops import permute_2D_sparse_data

OPS = [torch.ops.recpipe.permute_2D_sparse_data, torch.ops.recpipe.permute_sparse_data]
CALLS = OPS + [permute_2D_sparse_data]  # the Python entry point runs the kernels directly


def assert_same(got, ref) -> None:
    assert len(got) == 3
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.equal(g.cpu(), r), (g, r)


def buffers(case: Case, n: int, extra: int = 0, fill: int = -7):
    """Out-buffers poisoned with ``fill``, ``extra`` elements larger than needed."""
    T_out, dev = case.permute.numel(), case.lengths.device
    B = case.lengths.shape[1] if case.lengths.dim() == 2 else 1
    lo = torch.full((T_out * B + extra,), fill, dtype=case.lengths.dtype, device=dev)
    vo = torch.full((n + extra,), fill, dtype=case.values.dtype, device=dev)
    wo = None
    if case.weights is not None:
        wo = torch.full((n + extra,), fill, dtype=case.weights.dtype, device=dev)
    return lo, vo, wo


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(0, 12),
    B=st.one_of(st.none(), st.integers(0, 9)),
    T_out=st.integers(0, 16),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    permute_dtype=st.sampled_from([torch.int32, torch.int64]),
    values_dtype=st.sampled_from([torch.int32, torch.int64, torch.float32]),
    weights_dtype=st.sampled_from([None, torch.float32, torch.float64, torch.float16]),
    give_sum=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parity_with_fbgemm(
    T, B, T_out, index_dtype, permute_dtype, values_dtype, weights_dtype, give_sum, seed
) -> None:
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        case = make_case(
            T, B, T_out if T else 0, index_dtype=index_dtype, permute_dtype=permute_dtype,
            values_dtype=values_dtype, weights_dtype=weights_dtype, seed=seed,
        ).to(device)
        ref = fbgemm_reference(case)
        n = int(ref[0].sum()) if give_sum else None
        for op in CALLS:
            assert_same(op(*case.args(), n), ref)


@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("extra", [0, 5])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_out_buffers_are_written_in_place(device, give_sum: bool, extra: int, call) -> None:
    case = make_case(9, 4, 12, seed=1).to(device)
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())
    lo, vo, wo = buffers(case, n, extra)
    got = call(*case.args(), n if give_sum else None, lo, vo, wo)
    assert_same(got, ref)
    for out, buf in zip(got, (lo, vo, wo)):
        assert out.data_ptr() == buf.data_ptr()
    if extra:  # nothing written past the front
        for buf in (lo, vo, wo):
            assert (buf[-extra:] == -7).all()


def test_out_buffers_allocate_nothing_else_for_results(device) -> None:
    """Only the given buffers back the results; a missing one is allocated."""
    case = make_case(6, 3, 6, seed=2).to(device)
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())
    _, vo, _ = buffers(case, n)
    lengths, values, weights = permute_2D_sparse_data(*case.args(), n, None, vo, None)
    assert values.data_ptr() == vo.data_ptr()
    assert_same((lengths, values, weights), ref)


def test_values_longer_than_lengths_sum(device) -> None:
    case = make_case(5, 3, 7, extra_values=11, seed=3).to(device)
    assert_same(permute_2D_sparse_data(*case.args()), fbgemm_reference(case))


# --- errors -------------------------------------------------------------------------------------


def _valid(device):
    case = make_case(4, 3, 5, seed=4).to(device)
    n = int(fbgemm_reference(case)[0].sum())
    return case, n


@pytest.mark.parametrize(
    "which, make_bad, err, match",
    [
        ("permuted_lengths_out", lambda b: b.to(torch.float32), TypeError, "must have dtype"),
        ("permuted_indices_out", lambda b: b.to(torch.int32), TypeError, "must have dtype"),
        ("permuted_weights_out", lambda b: b.to(torch.float64), TypeError, "must have dtype"),
        ("permuted_indices_out", lambda b: b[:-1], ValueError, "too small"),
        ("permuted_lengths_out", lambda b: b[:-1], ValueError, "too small"),
        ("permuted_weights_out", lambda b: b[:-1], ValueError, "too small"),
        ("permuted_indices_out", lambda b: torch.cat([b, b])[::2], ValueError, "contiguous"),
        ("permuted_indices_out", lambda b: b.to("meta"), ValueError, "device"),
    ],
)
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_bad_out_buffer_is_named(device, which, make_bad, err, match, call) -> None:
    case, n = _valid(device)
    lo, vo, wo = buffers(case, n)
    kwargs = dict(permuted_lengths_out=lo, permuted_indices_out=vo, permuted_weights_out=wo)
    kwargs[which] = make_bad(kwargs[which])
    with pytest.raises(err, match=f"{which}.*{match}"):
        call(*case.args(), n, **kwargs)


@pytest.mark.parametrize(
    "change, err, match",
    [
        (lambda c: c.__setattr__("permute", c.permute.float()), TypeError, "permute must be int"),
        (lambda c: c.__setattr__("lengths", c.lengths.float()), TypeError, "lengths must be int"),
        (lambda c: c.__setattr__("permute", c.permute.view(-1, 1)), ValueError, "permute must be 1D"),
        (lambda c: c.__setattr__("lengths", c.lengths[None]), ValueError, "lengths must be 1D"),
        (lambda c: c.__setattr__("values", c.values.view(-1, 1)), ValueError, "values must be 1D"),
        (lambda c: c.__setattr__("weights", c.weights[1:]), ValueError, "weights must have"),
        (lambda c: c.__setattr__("values", c.values.to("meta")), ValueError, "values must be on"),
    ],
)
def test_bad_input_is_named(device, change, err, match) -> None:
    case, _ = _valid(device)
    change(case)
    with pytest.raises(err, match=match):
        permute_2D_sparse_data(*case.args())


@pytest.mark.parametrize("bad_index", [-1, 4, 1000])
def test_out_of_range_permute_raises(bad_index: int) -> None:
    case, n = _valid("cpu")
    case.permute[2] = bad_index
    with pytest.raises(IndexError, match=rf"out of range.*\[0, 4\).*{bad_index}"):
        permute_2D_sparse_data(*case.args())
    lo, vo, wo = buffers(case, n)
    with pytest.raises(IndexError, match="out of range"):
        permute_2D_sparse_data(*case.args(), n, lo, vo, wo)


def test_wrong_permuted_lengths_sum_raises() -> None:
    case, n = _valid("cpu")
    for wrong in (n - 1, n + 1):
        with pytest.raises(ValueError, match=f"permuted_lengths_sum={wrong}"):
            permute_2D_sparse_data(*case.args(), wrong)
    with pytest.raises(ValueError, match="must be >= 0"):
        permute_2D_sparse_data(*case.args(), -1)


def test_weights_out_without_weights_raises() -> None:
    case, n = _valid("cpu")
    _, _, wo = buffers(case, n)
    with pytest.raises(ValueError, match="permuted_weights_out given but weights is None"):
        permute_2D_sparse_data(case.permute, case.lengths, case.values, None, n, None, None, wo)


def test_lengths_longer_than_values_raises() -> None:
    case, _ = _valid("cpu")
    with pytest.raises(ValueError, match="values has"):
        permute_2D_sparse_data(case.permute, case.lengths, case.values[:-1], None)


# --- opcheck and torch.compile ------------------------------------------------------------------


def _opcheck_arg_sets(device):
    case = make_case(6, 3, 8, seed=5).to(device)
    n = int(fbgemm_reference(case)[0].sum())
    yield case.args() + (n,)
    yield case.args() + (None,)
    yield (case.permute, case.lengths, case.values, None, n)
    yield case.args() + (n, *buffers(case, n))
    yield case.args() + (None, *buffers(case, n))
    yield case.args() + (n, *buffers(case, n, extra=3))


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_opcheck_public_op(device, op) -> None:
    for args in _opcheck_arg_sets(device):
        torch.library.opcheck(op.default, args)


def test_opcheck_primitives(device) -> None:
    case = make_case(6, 3, 8, seed=6).to(device)
    n = int(fbgemm_reference(case)[0].sum())
    torch.library.opcheck(torch.ops.recpipe._permuted_lengths_sum.default, (case.permute, case.lengths))
    torch.library.opcheck(
        torch.ops.recpipe._permute_2D_sparse_data_into.default,
        case.args() + (n, *buffers(case, n)),
    )


@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("with_out", [True, False])
def test_torch_compile_fullgraph(device, give_sum: bool, with_out: bool) -> None:
    torch._dynamo.reset()
    case = make_case(7, 5, 9, seed=7).to(device)
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())
    outs = buffers(case, n, extra=2) if with_out else (None, None, None)

    @torch.compile(fullgraph=True, dynamic=False)
    def f(permute, lengths, values, weights, lo, vo, wo):
        lengths_out, values_out, weights_out = permute_2D_sparse_data(
            permute, lengths, values, weights, n if give_sum else None, lo, vo, wo
        )
        return lengths_out, values_out, weights_out

    got = f(*case.args(), *outs)
    assert_same(got, ref)
    if with_out:
        for out, buf in zip(got, outs):
            assert out.data_ptr() == buf.data_ptr()
