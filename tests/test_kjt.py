"""recpipe.kjt: KJT permutes into given buffers; the scoped redirect of torchrec's permutes."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.kjt import (
    PermuteInto, PermuteSpec, RedirectStats, allocate, kjt_permute_spec, permute_kjt,
    redirecting_kjt_type, write_into,
)
from recpipe.pipeline.buffers import (
    AllToAllOutputs, BufferRing, CopyRing, HighWater, main_stream_allocator, padded_allocator,
)
from recpipe.pipeline.sparse_dist import _with_kjt_type


def _kjt(weighted: bool = True, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (4 * 3,), generator=g)
    n = int(lengths.sum())
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c", "d"],
        values=torch.randint(0, 1000, (n,), generator=g),
        lengths=lengths,
        weights=torch.rand(n, generator=g) if weighted else None,
    )


def _same(x: KeyedJaggedTensor, y: KeyedJaggedTensor) -> None:
    assert x.keys() == y.keys() and x.stride() == y.stride()
    assert x.length_per_key() == y.length_per_key()
    assert torch.equal(x.lengths(), y.lengths()) and torch.equal(x.values(), y.values())
    assert (x.weights_or_none() is None) == (y.weights_or_none() is None)
    if x.weights_or_none() is not None:
        assert torch.equal(x.weights(), y.weights())


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("indices", [[3, 1, 0, 2], [2, 2, 0], [1]])
def test_permute_kjt_matches_torchrec_in_the_buffers(weighted: bool, indices: list[int]) -> None:
    kjt = _kjt(weighted)
    buffers = allocate(kjt_permute_spec(kjt, indices))
    out = permute_kjt(kjt, indices, buffers)
    _same(out, kjt.permute(indices))
    assert out.values().data_ptr() == buffers.values.data_ptr()
    assert out.lengths().data_ptr() == buffers.lengths.data_ptr()
    if weighted:
        assert out.weights().data_ptr() == buffers.weights.data_ptr()


def test_permute_kjt_rejects_small_buffers() -> None:
    kjt = _kjt()
    spec = kjt_permute_spec(kjt, [0, 1, 2, 3])
    buffers = allocate(spec)
    buffers.values = buffers.values[:-1]
    with pytest.raises(ValueError, match="too small"):
        permute_kjt(kjt, [0, 1, 2, 3], buffers)


def test_mode_redirects_only_sized_2d_permutes_and_passes_the_rest() -> None:
    kjt = _kjt()
    handed_out = []

    def alloc(spec):
        handed_out.append(allocate(spec))
        return handed_out[-1]

    mode = PermuteInto(write_into(alloc))
    with mode:
        out = kjt.permute([2, 0])  # torchrec passes permuted_lengths_sum: redirected
        unsized = torch.ops.fbgemm.permute_2D_sparse_data(  # no size: left to fbgemm
            torch.tensor([1, 0], dtype=torch.int32), kjt.lengths().view(4, -1), kjt.values()
        )
        other = torch.add(torch.ones(2), 1)  # anything else: untouched
    assert mode.calls == 1 and len(handed_out) == 1
    assert out.values().data_ptr() == handed_out[0].values.data_ptr()
    _same(out, kjt.permute([2, 0]))
    assert unsized[0].shape == (2, 3) and torch.equal(other, torch.full((2,), 2.0))


def test_mode_is_scoped_to_its_thread() -> None:
    kjt = _kjt()
    calls = []
    seen_in_thread = []

    def other_thread():
        kjt.permute([1, 0])  # must not reach the mode of the main thread
        seen_in_thread.append(len(calls))

    with PermuteInto(write_into(lambda spec: calls.append(spec) or allocate(spec))):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen_in_thread == [0] and calls == []


def test_ring_reuses_slots_per_batch_and_grows_when_needed() -> None:
    ring = BufferRing(main=None, depth=2)
    small, big = _kjt(seed=1), _kjt(seed=2)
    spec_small = kjt_permute_spec(small, [0, 1, 2, 3])
    first = ring.allocator(0)(spec_small).values.data_ptr()
    ring.release(0)
    again = ring.allocator(2)(spec_small)  # batch 2 takes batch 0's slot, same memory
    assert again.values.data_ptr() == first
    other = ring.allocator(1)(spec_small)  # batch 1: the other slot
    assert other.values.data_ptr() != first
    ring.release(2)
    del again, other  # results dropped: their slots can be reused in place
    larger = kjt_permute_spec(big, [0, 1, 2, 3, 3, 2, 1, 0])  # twice the values
    grown = ring.allocator(4)(larger)
    assert grown.fits(larger) and grown.values.numel() >= larger.num_values
    alloc5 = ring.allocator(5)
    a, b = alloc5(spec_small), alloc5(spec_small)  # two permutes of one batch: two buffers
    assert a.values.data_ptr() != b.values.data_ptr()
    assert ring.replaced == 0


def test_ring_after_a_reset_waits_for_the_last_owner_of_the_same_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrec's ``reset`` numbers batches from 0 again: a new batch 0 must wait for the
    release of the dropped batch 0 in its slot, as any later owner does."""
    ring = BufferRing(main=None, depth=2)
    waited: list[object] = []
    monkeypatch.setattr(ring, "_wait_released", lambda slot: waited.append(slot.released))
    spec = kjt_permute_spec(_kjt(seed=1), [0, 1, 2, 3])
    ring.allocator(0)(spec)  # batch 0, dropped before its release
    ring.allocator(0)(spec)  # the same batch again (a second call of its input dist)
    assert waited == [True]  # (the first owner's: the slot was new)
    ring.forget_owners()
    ring.allocator(0)(spec)
    assert waited == [True, False]  # never released: the ring orders it after main's work


def test_ring_never_overwrites_a_result_still_held() -> None:
    """A caller that keeps an earlier batch's output (views of a slot) keeps its data."""
    ring = BufferRing(main=None, depth=2)
    spec = kjt_permute_spec(_kjt(seed=1), [0, 1, 2, 3])
    kept = ring.allocator(0)(spec).values[: spec.num_values // 2]  # a view, as a KJT holds
    kept.fill_(7)
    ring.release(0)
    reused = ring.allocator(2)(spec)
    reused.values.fill_(-1)
    assert reused.values.data_ptr() != kept.data_ptr() and ring.replaced == 1
    assert bool((kept == 7).all())
    ring.release(2)
    del kept, reused
    ring.allocator(4)(spec)  # nothing held any more: the slot's memory is reused again
    assert ring.replaced == 1


class _Event:
    def query(self) -> bool:
        return True


class _Stream:
    """A CPU stand-in for the copy / data_dist stream: records the events it waits on."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)

    def record_event(self) -> _Event:
        return _Event()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _copy(ring: CopyRing, index: int, stream: _Stream, fill: int) -> list[torch.Tensor]:
    """Batch ``index``'s copies through the ring: a dense tensor, then a KJT's values and
    lengths (what ``copy_batch`` does, with plain ``copy_``)."""
    into = ring.destination(index, stream)
    made = []
    for k, src in enumerate((torch.full((4, 3), fill), torch.full((100,), fill), torch.full((8,), fill))):
        out = into(k, src)
        made.append(src.clone() if out is None else out.copy_(src))
    return made


def _ptrs(*tensors: torch.Tensor) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_copy_ring_serves_the_early_freed_positions_and_reuses_the_released_slot() -> None:
    """The early free ends a batch's input dists, so the copy of batch i+1 waits for batch i's
    release event and writes batch i's memory; the first batch's memory is taken over."""
    ring, stream = CopyRing(), _Stream()
    first = _copy(ring, 0, stream, 0)  # nothing learned yet: all fresh
    adopted = _ptrs(*first[1:])
    assert ring.release_early(0, first, adopted, stream) == {1, 2}  # the slot takes them over
    # (sized as the ring sizes its buffers: 1/64 more than the first batch's)
    assert ring.nbytes == 100 * 8 * 65 // 64 + 8 * 8 * 65 // 64 and first[1].numel() == 0
    assert ring.storages() == adopted  # (what the pipeline's side writes let go of)
    b1 = _copy(ring, 1, stream, 1)  # the slot's memory, written again after its release
    assert _ptrs(*b1[1:]) == adopted and bool((b1[1] == 1).all()) and len(stream.waited) == 1
    assert ring.release_early(1, b1, adopted, stream) == {1, 2}
    assert b1[1].numel() == 0 and b1[2].numel() == 0  # emptied: nothing reads batch 2's data
    assert b1[0].numel() == 12  # the dense tensor is main's: left alone
    b2 = _copy(ring, 2, stream, 2)
    assert _ptrs(*b2[1:]) == adopted and len(stream.waited) == 2 and bool((b2[1] == 2).all())
    assert ring.replaced == 0 and ring.reused == 4


def test_copy_ring_keeps_a_slot_whose_tensors_were_not_all_freed_early() -> None:
    """A served tensor that was not a P1 input (the batch's structure changed) may be read by
    main: the slot waits for main's release, and a copy before it gets fresh memory."""
    ring, stream = CopyRing(), _Stream()
    first = _copy(ring, 0, stream, 0)
    ring.release_early(0, first, _ptrs(*first[1:]), stream)
    b1 = _copy(ring, 1, stream, 1)
    assert ring.release_early(1, b1, _ptrs(b1[1]), stream) == {1, 2}  # lengths: not an input
    assert b1[2].numel() == 8  # not emptied: someone else reads it
    b2 = _copy(ring, 2, stream, 2)  # slot not released: fresh memory, batch 1's data kept
    assert not _ptrs(*b2[1:]) & _ptrs(*b1[1:]) and bool((b1[2] == 1).all())
    ring.release_late(2, stream)  # (only the values are served now: the learned positions)
    values = _ptrs(b2[1])
    del b2  # the batch is dropped after its step
    b3 = _copy(ring, 3, stream, 3)  # released by main: reused
    assert _ptrs(b3[1]) == values and ring.replaced == 0


def test_copy_ring_never_overwrites_memory_still_held() -> None:
    ring, stream = CopyRing(), _Stream()
    first = _copy(ring, 0, stream, 0)
    ring.release_early(0, first, _ptrs(*first[1:]), stream)
    b1 = _copy(ring, 1, stream, 1)
    kept = b1[1][:10]  # a view someone kept before the release
    lengths = _ptrs(b1[2])
    ring.release_early(1, b1, _ptrs(*b1[1:]), stream)
    b2 = _copy(ring, 2, stream, 2)
    assert bool((kept == 1).all()) and ring.replaced == 1 and not _ptrs(b2[1]) & _ptrs(kept)
    assert _ptrs(b2[2]) == lengths  # nobody holds the lengths: reused


def test_copy_ring_leaves_empty_tensors_to_the_allocator() -> None:
    """An empty P1 input (a batch without ids) has no memory to reuse; the slot is still
    released early."""
    ring, stream = CopyRing(), _Stream()
    first = _copy(ring, 0, stream, 0)
    ring.release_early(0, first, _ptrs(*first[1:]), stream)
    into = ring.destination(1, stream)
    assert into(1, torch.empty(0, dtype=torch.int64)) is None
    lengths = into(2, torch.zeros(8, dtype=torch.int64))
    assert lengths is not None
    assert ring.release_early(1, [torch.empty(4, 3), torch.empty(0), lengths], _ptrs(lengths), stream) == {2}


def test_high_water_sizes_repeat_until_a_batch_outgrows_them() -> None:
    """Equal sizes from batch to batch (a freed block fits the next batch's tensor), 1/64 more
    than the largest when a batch outgrows them; each key on its own."""
    sizes = HighWater()
    assert sizes.numel("values", 640) == 650
    assert sizes.numel("values", 600) == 650 and sizes.numel("values", 650) == 650
    assert sizes.numel("values", 651) == 661 and sizes.numel("lengths", 10) == 10
    t = sizes.empty("dense", (64, 2), torch.float32, torch.device("cpu"))
    assert t.shape == (64, 2) and t.is_contiguous()
    assert t.untyped_storage().nbytes() == (128 + 2) * 4


def test_sized_allocations_repeat_per_site() -> None:
    """P1's buffers are keyed by the call's order in the batch (two permutes of the same
    shape keep their own sizes); the all-to-all outputs by their order in the splits wait."""
    spec = PermuteSpec((2, 4), torch.int64, 1000, torch.int64, None, torch.device("cpu"))
    sizes = HighWater()
    alloc = padded_allocator(sizes)
    big, small = alloc(spec), alloc(replace(spec, num_values=10))
    assert big.values.numel() == 1015 and small.values.numel() == 10
    again = padded_allocator(sizes)(replace(spec, num_values=990))  # the next batch, a bit smaller
    assert again.values.numel() == 1015
    recat = main_stream_allocator(None, padded_allocator(HighWater(), by_call=False))  # P2's
    first, other_module = recat(spec), recat(replace(spec, lengths_shape=(3, 4), num_values=10))
    next_batch = recat(replace(spec, num_values=990))
    assert first.values.numel() == next_batch.values.numel() == 1015
    assert other_module.values.numel() == 10
    assert main_stream_allocator(None)(spec).values.numel() == 1000  # exact without sizes
    received = HighWater()
    for n in (640, 630):  # two batches' splits waits
        with AllToAllOutputs(received, torch.device("cpu")) as mode:
            out = torch.empty([n], device=torch.device("cpu"), dtype=torch.int64)
            other = torch.empty(4, 2, device="cpu")  # not torchrec's form for them: as is
        assert out.shape == (n,) and out.untyped_storage().nbytes() == 650 * 8 and mode.made == 1
        assert other.untyped_storage().nbytes() == 4 * 2 * 4


def test_an_input_dist_that_sends_a_kjt_unpermuted_marks_it_sent_whole() -> None:
    """Two modules' input dists over one KJT: one permutes it (P1), the other sends the KJT's
    own tensors (its features already in order). The KJT is then sent whole, so the pipeline
    neither frees it early nor plans its permuted copy."""
    permuted: list[KeyedJaggedTensor] = []
    sent_whole: list[KeyedJaggedTensor] = []
    kjt_type = redirecting_kjt_type(lambda: None, lambda: None, RedirectStats(), permuted.append)
    shared, other = _kjt(seed=1), _kjt(seed=2)

    def permuting(ctx: object, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return features.permute([3, 2, 1, 0])

    def in_order(ctx: object, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return features

    _with_kjt_type(permuting, kjt_type, permuted, sent_whole)(None, shared)
    _with_kjt_type(permuting, kjt_type, permuted, sent_whole)(None, other)
    assert [id(k) for k in permuted] == [id(shared), id(other)] and sent_whole == []
    _with_kjt_type(in_order, kjt_type, permuted, sent_whole)(None, shared)
    assert [id(k) for k in sent_whole] == [id(shared)]
    assert type(shared) is KeyedJaggedTensor  # its class back after the call
