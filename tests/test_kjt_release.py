"""recpipe.kjt.release_storage frees only what its caller owns, whole storages only."""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.kjt import copy_batch, release_storage


def _kjt(values: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, torch.tensor([1, 2, 0, 3]))


def test_frees_owned_whole_storages_only() -> None:
    kjt = _kjt(torch.arange(6))
    owned = {kjt.values().untyped_storage().data_ptr()}
    assert release_storage(kjt, owned) == 6 * 8
    assert kjt.values().untyped_storage().nbytes() == 0
    assert kjt.lengths().untyped_storage().nbytes() == 4 * 8  # not owned: kept


def test_leaves_views_and_foreign_tensors() -> None:
    packed = torch.arange(10)
    kjt = _kjt(packed[:6])  # a view into a larger buffer
    assert release_storage(kjt, {packed.untyped_storage().data_ptr()}) == 0
    assert packed.untyped_storage().nbytes() == 10 * 8
    other = _kjt(torch.arange(6))
    assert release_storage(other, set()) == 0 and other.values().tolist() == list(range(6))


def test_copy_batch_without_a_stream_is_plain_to() -> None:
    kjt = _kjt(torch.arange(6))
    made: list[torch.Tensor] = []
    out = copy_batch(kjt, torch.device("cpu"), None, made)
    assert out.values() is kjt.values() and made == []  # nothing copied, nothing owned


class _Stream:
    """A CUDA stream stand-in that records the order of its waits and events."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.device, self.n = name, log, torch.device("cpu"), 0

    def record_event(self) -> str:
        self.n += 1
        return f"{self.name}{self.n}"

    def wait_event(self, event: str) -> None:
        self.log.append(f"wait {event}")

    def wait_stream(self, stream: "_Stream") -> None:
        self.log.append(f"wait all of {stream.name}")


def test_copy_ring_reuses_a_slot_after_the_release_of_the_batch_two_before(monkeypatch) -> None:
    from recpipe.pipeline.buffers import CopyRing

    log: list[str] = []
    main, data_dist, memcpy = (_Stream(n, log) for n in ("main", "data_dist", "memcpy"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: memcpy)
    ring = CopyRing(main)  # type: ignore[arg-type]
    src = [torch.arange(100), torch.ones(3)]  # k=0: the KJT's values (freed early), k=1: dense

    def copy(i: int) -> list[int]:
        into = ring.into(i)
        outs = [into(k, t) for k, t in enumerate(src)]
        made = [t.clone() if o is None else o.copy_(t) for o, t in zip(outs, src)]
        return [t.untyped_storage().data_ptr() for t in made]

    first = copy(0)
    assert ring.handed(0) == set(first) and log == []  # nothing learned yet: all in the ring
    ring.release_read(0, {first[0]}, first, data_dist)  # P1 read position 0 only
    ring.release(0)  # the dense copy was in the slot: main's end-of-step event frees it
    assert ring.nbytes == (100 + 100 // 64) * 8  # the dense buffer left the ring
    for i in (1, 2, 3):
        ptrs = copy(i)
        assert ring.handed(i) == {ptrs[0]}  # the values go to the ring, the dense part not
        ring.release_read(i, {ptrs[0]}, ptrs, data_dist)
        ring.release(i)  # main's end-of-step event: not needed, the read released it
    # batch 2 reused batch 0's slot after main's event, batch 3 batch 1's after data_dist's
    assert log == ["wait main1", "wait data_dist1"] and copy(4)[0] == ring.handed(4).pop()
    assert log[-1] == "wait data_dist2"
    ring.release(4)  # not read in P1 (structure changed): main's end-of-step event frees it
    copy(6)
    assert log[-1] == "wait main2"
