"""recpipe::permute_2D_sparse_data: fbgemm parity (its permute_2D_sparse_data and, where installed,
its permute_2D_sparse_preallocated_out), zero-copy, errors, autograd, opcheck, compile."""

from __future__ import annotations

import contextlib
import re
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from permute_cases import (
    HAS_FBGEMM_PREALLOCATED_OUT,
    Case,
    fbgemm_preallocated_out,
    fbgemm_reference,
    make_case,
)

import recpipe.ops  # noqa: F401  (registers torch.ops.recpipe)
import recpipe.ops.permute as permute_module
from recpipe.ops import permute_2D_sparse_data

OPS = [torch.ops.recpipe.permute_2D_sparse_data, torch.ops.recpipe.permute_sparse_data]
PREFIX = r"^recpipe\.permute_2D_sparse_data: "  # of every error message
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


#: the op's inputs (``make_case``'s arguments) but ``B``
CASES = dict(
    T=st.integers(0, 12),
    T_out=st.integers(0, 16),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    permute_dtype=st.sampled_from([torch.int32, torch.int64]),
    values_dtype=st.sampled_from([torch.int32, torch.int64, torch.float32]),
    weights_dtype=st.sampled_from([None, torch.float32, torch.float64, torch.float16]),
    give_sum=st.booleans(),
    seed=st.integers(0, 2**16),
)


@pytest.mark.parametrize("cpu_kernel", ["fbgemm", "torch"])  # torch: where fbgemm is absent
@settings(max_examples=60, deadline=None)
@given(B=st.one_of(st.none(), st.integers(0, 9)), **CASES)
def test_parity_with_fbgemm(
    cpu_kernel, T, B, T_out, index_dtype, permute_dtype, values_dtype, weights_dtype, give_sum,
    seed,
) -> None:
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        case = make_case(
            T, B, T_out if T else 0, index_dtype=index_dtype, permute_dtype=permute_dtype,
            values_dtype=values_dtype, weights_dtype=weights_dtype, seed=seed,
        ).to(device)
        ref = fbgemm_reference(case)
        n = int(ref[0].sum()) if give_sum else None
        with _cpu_kernel(cpu_kernel):
            for op in CALLS:
                assert_same(op(*case.args(), n), ref)


def _cpu_kernel(name: str):
    """The CPU kernel behind the op: fbgemm's where installed (the default), or torch's."""
    if name == "fbgemm":
        return contextlib.nullcontext()
    return mock.patch.object(permute_module, "_fbgemm_cpu", return_value=None)


@pytest.mark.skipif(not HAS_FBGEMM_PREALLOCATED_OUT, reason="fbgemm_gpu < 1.8")
@pytest.mark.parametrize(
    "values_dtype, weights_dtype, fbgemm",
    [(torch.int64, torch.float32, True), (torch.int32, None, True),
     (torch.float64, None, False), (torch.int64, torch.bfloat16, False)],
)
def test_cpu_kernel_is_fbgemms_where_it_takes_the_dtypes(values_dtype, weights_dtype, fbgemm) -> None:
    """fbgemm's kernel for the dtypes it takes, the torch-op path for the others; the same
    results either way (the reference: fbgemm's op moving the values' positions)."""
    case = make_case(5, 3, 7, values_dtype=values_dtype, weights_dtype=weights_dtype)
    positions = torch.arange(case.values.numel())
    lengths, moved, _ = fbgemm_reference(Case(case.permute, case.lengths, positions, None))
    ref = (lengths, case.values[moved], None if case.weights is None else case.weights[moved])
    n = int(case.lengths[case.permute.long()].sum())
    out = buffers(case, n)
    spy = mock.MagicMock(wraps=torch.ops.fbgemm.permute_2D_sparse_preallocated_out)
    with mock.patch.object(permute_module, "_fbgemm_preallocated_out", return_value=spy):
        got = permute_2D_sparse_data(*case.args(), n, *out)
    assert spy.call_count == int(fbgemm)
    assert_same(got, ref)


@pytest.mark.parametrize("B", [4, None], ids=["2D", "1D"])  # (fbgemm's preallocated op: 2D only)
@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("extra", [0, 5])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_out_buffers_are_written_in_place(device, B, give_sum: bool, extra: int, call) -> None:
    case = make_case(9, B, 12, seed=1).to(device)
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


def _front_of(result: torch.Tensor, buf: torch.Tensor) -> bool:
    """``result`` starts where ``buf`` does, in its storage (``data_ptr()`` is 0 for an empty
    tensor, so compare the storages)."""
    same_storage = result.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    return same_storage and result.storage_offset() == buf.storage_offset()


@pytest.mark.skipif(
    not HAS_FBGEMM_PREALLOCATED_OUT,
    reason="this fbgemm_gpu has no permute_2D_sparse_preallocated_out (fbgemm_gpu >= 1.8)",
)
@settings(max_examples=40, deadline=None)
@given(B=st.integers(0, 9), extra=st.sampled_from([0, 5]), **CASES)
def test_parity_with_fbgemm_preallocated_out(
    T, B, T_out, index_dtype, permute_dtype, values_dtype, weights_dtype, give_sum, extra, seed
) -> None:
    """Into preallocated buffers, recpipe's op writes what fbgemm's own preallocated op writes:
    the same buffer contents, the results in front and the rest untouched. Exact-size buffers
    (the lengths one shaped [T', B]) come back as themselves from both: the same results. Larger
    ones: fbgemm returns them whole, recpipe the fronts in the output shapes."""
    case = make_case(
        T, B, T_out if T else 0, index_dtype=index_dtype, permute_dtype=permute_dtype,
        values_dtype=values_dtype, weights_dtype=weights_dtype, seed=seed,
    )
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())

    def outs(c: Case) -> tuple:
        lo, vo, wo = buffers(c, n, extra)
        return (lo.view(ref[0].shape) if extra == 0 else lo), vo, wo

    fb_outs = outs(case)
    fb = fbgemm_preallocated_out(case, n if give_sum else None, fb_outs)
    if extra == 0:
        assert_same(fb, ref)  # the anchor agrees with fbgemm's allocating op
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        dcase = case.to(device)
        for call in CALLS:
            our_outs = outs(dcase)
            got = call(*dcase.args(), n if give_sum else None, *our_outs)
            assert_same(got, fb if extra == 0 else ref)
            for result, ours, theirs in zip(got, our_outs, fb_outs):
                if theirs is None:
                    assert result is None and ours is None
                    continue
                assert _front_of(result, ours)
                assert torch.equal(ours.cpu(), theirs)


@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("empty", ["no output rows", "no batch", "zero lengths"])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_empty_input_returns_the_given_buffers(device, give_sum: bool, empty: str, call) -> None:
    """Nothing to permute: the results are the fronts of the given (larger) buffers, on every
    device; nothing is cloned (fbgemm's CUDA kernels return clones of the inputs when T' or B is
    0) and nothing past the front is written."""
    T, B, T_out, max_len = {
        "no output rows": (4, 3, 0, 6), "no batch": (4, 0, 5, 6), "zero lengths": (4, 3, 5, 0)
    }[empty]
    case = make_case(T, B, T_out, max_len=max_len, extra_values=4, seed=10).to(device)
    ref = fbgemm_reference(case)
    assert int(ref[0].sum()) == 0
    outs = buffers(case, 0, extra=2)
    got = call(*case.args(), 0 if give_sum else None, *outs)
    assert_same(got, ref)
    for result, buf in zip(got, outs):
        assert _front_of(result, buf)
        assert (buf[-2:] == -7).all()


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


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` as a view ``offset`` elements into a larger buffer."""
    buf = torch.empty(offset + t.numel(), dtype=t.dtype, device=t.device)
    return buf[offset:].view(t.shape).copy_(t)


@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_inputs_and_buffers_at_any_offset(device, call) -> None:
    """Views 1 element into their buffer (4 or 8 bytes: not 16-byte aligned), alternating with
    aligned ones, each twice: the CUDA kernels are specialized on alignment, and the later calls
    go through the cached launchers (recpipe.ops.permute_triton._launch)."""
    case = make_case(9, 5, 12, values_dtype=torch.int64, seed=8).to(device)
    ref = fbgemm_reference(case)
    n = int(ref[0].sum())
    for offset in (0, 1, 0, 1):
        moved = (_at_offset(t, offset) for t in case.args())
        outs = (_at_offset(b, offset) for b in buffers(case, n))
        got = call(*moved, n, *outs)
        assert_same(got, ref)


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


@pytest.mark.parametrize("negative", ["length", "row sum"])
@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("with_out", [True, False])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_negative_lengths_raise(
    device, negative: str, give_sum: bool, with_out: bool, call
) -> None:
    if give_sum and device.type == "cuda":
        pytest.skip("a device-side assert (tests/test_permute_triton.py checks its status flag)")
    case, n = _valid(device)
    outs = buffers(case, n) if with_out else ()
    if negative == "length":  # the row sum stays the same
        case.lengths[1, 0] += case.lengths[1, 1] + 1
        case.lengths[1, 1] = -1
    else:
        case.lengths[1] = torch.tensor([0, -2, 0])
    first = -1 if negative == "length" else -2
    with pytest.raises(ValueError, match=rf"{PREFIX}lengths must be >= 0, got \[{first}\]$"):
        call(*case.args(), n if give_sum else None, *outs)


def test_lengths_longer_than_values_raises() -> None:
    case, _ = _valid("cpu")
    with pytest.raises(ValueError, match="values has"):
        permute_2D_sparse_data(case.permute, case.lengths, case.values[:-1], None)


# --- autograd -----------------------------------------------------------------------------------


def _grads(call, case: Case, n: int | None, out_grads) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of float ``values`` and ``weights`` for upstream gradients ``out_grads``."""
    values = case.values.detach().clone().requires_grad_()
    weights = case.weights.detach().clone().requires_grad_()
    _, permuted_values, permuted_weights = call(case.permute, case.lengths, values, weights, n)
    dev = case.lengths.device
    torch.autograd.backward([permuted_values, permuted_weights], [g.to(dev) for g in out_grads])
    return values.grad.cpu(), weights.grad.cpu()


@pytest.mark.parametrize("give_sum", [True, False])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_grads_match_fbgemm(device, give_sum: bool, call) -> None:
    """A permutation of the rows (fbgemm's backward inverts the permute): the same gradients."""
    case = make_case(7, 4, 7, values_dtype=torch.float32, seed=20)
    case.permute = torch.randperm(7, generator=torch.Generator().manual_seed(20)).to(torch.int32)
    n = int(case.lengths.sum())
    g = torch.Generator().manual_seed(21)
    out_grads = [torch.randn(n, generator=g), torch.randn(n, generator=g)]
    ref = _grads(torch.ops.fbgemm.permute_2D_sparse_data, case, n, out_grads)
    got = _grads(call, case.to(device), n if give_sum else None, out_grads)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_grads_of_repeated_and_dropped_rows(device, B: int | None, call) -> None:
    """Each input value gets the sum of its copies' gradients; dropped rows and values past the
    lengths get 0 (reference: autograd of indexing the values with their source positions)."""
    case = make_case(6, B, 7, values_dtype=torch.float32, extra_values=3, seed=22)
    case.permute = torch.tensor([3, 0, 3, 5, 0, 3, 1], dtype=torch.int32)  # 2 and 4 dropped
    row_sums = case.lengths.view(6, -1).sum(1).tolist()
    starts = [sum(row_sums[:r]) for r in range(6)]
    positions = [starts[r] + k for r in case.permute.tolist() for k in range(row_sums[r])]
    g = torch.Generator().manual_seed(23)
    out_grads = [torch.randn(len(positions), generator=g) for _ in range(2)]
    ref = _grads(lambda p, lengths, v, w, n: (lengths, v[positions], w[positions]), case, None, out_grads)
    got = _grads(call, case.to(device), None, out_grads)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad_of", ["values", "weights"])
@pytest.mark.parametrize("which", range(3))
@pytest.mark.parametrize("call", CALLS, ids=lambda op: op.__name__)
def test_out_buffer_with_grad_raises(grad_of: str, which: int, call) -> None:
    case = make_case(4, 3, 5, values_dtype=torch.float32, seed=24)
    n = int(fbgemm_reference(case)[0].sum())
    outs: list = [None, None, None]
    outs[which] = buffers(case, n)[which]
    name = ("permuted_lengths_out", "permuted_indices_out", "permuted_weights_out")[which]
    args = dict(values=case.values, weights=case.weights)
    args[grad_of] = args[grad_of].detach().requires_grad_()
    message = f"{PREFIX}{name} must be None when {grad_of} requires grad$"
    with pytest.raises(ValueError, match=message):
        call(case.permute, case.lengths, args["values"], args["weights"], n, *outs)
    with torch.no_grad():  # nothing to record: the buffer is written
        got = call(case.permute, case.lengths, args["values"], args["weights"], n, *outs)
    assert got[which].data_ptr() == outs[which].data_ptr()


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
    floats = make_case(6, 3, 8, values_dtype=torch.float32, seed=6).to(device)
    n = int(fbgemm_reference(floats)[0].sum())
    # Not test_aot_dispatch_dynamic: it sums all outputs in place into the first, the int64
    # lengths, which fails on a float output (test_torch_compile_grads traces the backward).
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for weights in (floats.weights.requires_grad_(), None):
        args = (floats.permute, floats.lengths, floats.values.requires_grad_(), weights, n)
        torch.library.opcheck(
            torch.ops.recpipe._permute_2D_sparse_data_functional.default, args, test_utils=checks
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


def test_torch_compile_grads(device) -> None:
    torch._dynamo.reset()
    case = make_case(7, 5, 9, values_dtype=torch.float32, seed=7).to(device)
    n = int(fbgemm_reference(case)[0].sum())

    def loss(permute, lengths, values, weights):
        _, permuted_values, permuted_weights = permute_2D_sparse_data(
            permute, lengths, values, weights, n
        )
        return (permuted_values * permuted_values).sum() + (permuted_weights * 3).sum()

    grads = []
    for f in (loss, torch.compile(loss, fullgraph=True, dynamic=False)):
        values = case.values.detach().clone().requires_grad_()
        weights = case.weights.detach().clone().requires_grad_()
        f(case.permute, case.lengths, values, weights).backward()
        grads.append((values.grad, weights.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_registrations_follow_torchs_custom_op_rules(device) -> None:
    """No custom op returns an alias of its inputs (torch >= 2.13 deprecates that under
    torch.compile): the into-buffers primitive mutates its declared outputs and returns nothing,
    the differentiable one returns new tensors, and the public op is composite (decomposed before
    tracing). Compiling and checking them warns nothing."""
    into = torch.ops.recpipe._permute_2D_sparse_data_into.default._schema
    functional = torch.ops.recpipe._permute_2D_sparse_data_functional.default._schema
    assert not into.returns and not any(r.alias_info for r in functional.returns)
    torch._dynamo.reset()
    case = make_case(5, 3, 6, seed=9).to(device)
    n = int(fbgemm_reference(case)[0].sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(permute_2D_sparse_data, fullgraph=True, dynamic=False)
        f(*case.args(), n, *buffers(case, n, extra=1))
        for args in _opcheck_arg_sets(device):
            torch.library.opcheck(torch.ops.recpipe.permute_2D_sparse_data.default, args)
    # (importing torchrec under torch 2.13 warns that torch.jit.script_method is deprecated)
    about_ops = re.compile(r"alias|custom.?op|Tag\.|recpipe", re.IGNORECASE)
    deprecations = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
                    and about_ops.search(str(w.message))]
    assert deprecations == [], [str(w.message) for w in deprecations]
