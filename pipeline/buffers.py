"""Where the pipeline's permute outputs live, and how their streams are ordered.

Two allocators for :class:`recpipe.kjt.PermuteInto`, one per permute site (docs/design.md):

- :func:`main_stream_allocator` (P2, the recat in ``dist_init``): the buffers come from the
  **main** stream's pool, so they are reusable as soon as main drops the KJT, with no
  ``record_stream``. The data_dist stream waits on an event recorded on main after the
  allocation (a block handed to main may still be read by main's queued kernels).
  :class:`AllToAllOutputs` sizes the all-to-all outputs (P2's inputs, data_dist's pool) by
  :class:`HighWater`: equal sizes from batch to batch, so that freed blocks fit.
- :class:`BufferRing` (P1, the feature-order permute in ``input_dist``; with ``recat="ring"``,
  P2 too, one slot): pipeline-owned buffers, one slot per batch in flight, written only after an
  event recorded on main at the end of the step that last used it. Whole permute (3 slots):
  written on data_dist; that step was queued a step earlier, so the wait costs nothing and no
  host sync on data_dist waits for main's queued work. Split permute
  (:meth:`BufferRing.split_runner`, 2 slots, values/weights only): written on a side stream,
  which alone waits for the slot.

And one for the host-to-device copy (:class:`CopyRing`): pipeline-owned memory for the batch
tensors that the input dists alone read, reused once data_dist has queued those reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from recpipe.kjt import (
    Allocator,
    Destination,
    PermuteBuffers,
    PermuteSpec,
    Runner,
    allocate,
    write_into,
)

_HEADROOM = 64  # value buffers get 1/64 more than a batch needs: regrowth stays rare


def _with_headroom(n: int) -> int:
    """``n`` elements plus 1/64: the size a recurring buffer takes when it grows."""
    return n + n // _HEADROOM


class HighWater:
    """Sizes for allocations that recur once per batch at one place (a hashable key): the
    largest number of elements asked there so far, with 1/64 more each time it grows.

    Why: batch sizes vary a little from batch to batch. With exact sizes, the block that one
    batch's tensor freed is a little too small for the next batch's, so the caching allocator
    takes a new segment, and the pool keeps both (one extra batch-sized segment per pool;
    docs/design.md). With equal sizes each freed block fits the next batch's tensor. Cost: up to
    1/64 more bytes per tensor, and a larger size is kept after a larger batch."""

    def __init__(self) -> None:
        self._numel: dict[Hashable, int] = {}

    def numel(self, key: Hashable, n: int) -> int:
        """Elements to allocate at ``key`` for a tensor of ``n`` (at least ``n``)."""
        have = self._numel.get(key, -1)
        if n > have:
            have = _with_headroom(n)
            self._numel[key] = have
        return have

    def empty(self, key: Hashable, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """A contiguous ``shape`` tensor at the front of a :meth:`numel`-sized allocation (on
        the current stream)."""
        n = math.prod(shape)
        return torch.empty(self.numel(key, n), dtype=dtype, device=device)[:n].view(shape)

    def like(self, key: Hashable, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A tensor of ``src``'s dtype and shape on ``device``, at the start of a byte buffer
        sized at ``key`` (:func:`on_storage`: a ring may take the buffer over later)."""
        size = src.numel() * src.element_size()
        return on_storage(self.empty(key, (size,), torch.uint8, device), src)


def padded_allocator(sizes: HighWater, by_call: bool = True) -> Allocator:
    """Exact lengths, values (and weights) sized by ``sizes``, keyed by the lengths' shape and
    the dtypes, and with ``by_call`` by the call's order too (one allocator per batch: its
    ``k``-th permute is the same site from batch to batch; without it, one allocator for all
    batches, whose sites differ in shape: one module's recat)."""
    calls = 0

    def padded(spec: PermuteSpec) -> PermuteBuffers:
        nonlocal calls
        key = (calls if by_call else None, spec.lengths_shape, spec.values_dtype,
               spec.weights_dtype)
        calls += 1
        return allocate(replace(spec, num_values=sizes.numel(key, spec.num_values)))

    return padded


def main_stream_allocator(main: torch.cuda.Stream | None, alloc: Allocator = allocate) -> Allocator:
    """``alloc`` with ``main`` current (its buffers come from main's pool), then the current
    (data_dist) stream waits on an event recorded on main after the allocation: a block handed
    to main may still be read by main's queued kernels.

    The caller keeps a Python reference until the main stream's reads are queued, and main must
    wait on data_dist before reading (torchrec's ``PipelinedForward`` does). ``main=None`` (CPU)
    allocates plainly.
    """
    if main is None:
        return alloc

    def on_main(spec: PermuteSpec) -> PermuteBuffers:
        with main:  # torch.Stream as a context: C++, unlike torch.cuda.stream()
            out = alloc(spec)
            allocated = torch.cuda.Event()
            allocated.record(main)
        torch.cuda.current_stream(main.device).wait_event(allocated)
        return out

    return on_main


class AllToAllOutputs(TorchFunctionMode):
    """Within the block, each ``torch.empty(shape, device=device, ...)`` (how torchrec's
    ``KJTAllToAllTensorsAwaitable`` makes the all-to-all outputs: the received lengths, values,
    weights) is sized by ``sizes`` (keyed by its order in the block, dtype and trailing dims;
    None: exact sizes), on the current (data_dist) stream. Every other call runs unchanged.
    Scoped to the splits wait of the input dists. ``before()`` runs once, before the first
    output is made: after the host's read of the first fused splits all-to-all, before any
    tensor all-to-all is queued (or on exit, if none was)."""

    def __init__(
        self, sizes: HighWater | None, device: torch.device,
        before: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._sizes, self._device, self._before = sizes, device, before
        #: the all-to-all outputs made in the block
        self.made = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (func is not torch.empty or device is None or len(args) != 1
                or not isinstance(args[0], (list, tuple)) or set(kwargs) - {"device", "dtype"}
                or torch.device(device).type != self._device.type):
            return func(*args, **kwargs)
        shape, dtype = tuple(args[0]), kwargs.get("dtype") or torch.get_default_dtype()
        self._run_before()
        key = (self.made, dtype, shape[1:])
        self.made += 1
        if self._sizes is None:
            return func(*args, **kwargs)
        return self._sizes.empty(key, shape, dtype, torch.device(device))

    def __exit__(self, exc_type, exc_value, traceback):  # noqa: ANN001
        out = super().__exit__(exc_type, exc_value, traceback)
        self._run_before()  # (no output made: nothing was sent)
        return out

    def _run_before(self) -> None:
        if self._before is not None:
            before, self._before = self._before, None
            before()


class SideWrite(NamedTuple):
    """A split permute's values/weights write on the side stream: ``event`` recorded after it;
    ``inputs``, the data_dist tensors it reads, kept alive until data_dist has waited on
    ``event`` (so that data_dist cannot reuse their memory before the side stream read it)."""

    event: torch.cuda.Event
    inputs: tuple[torch.Tensor | None, ...]


@dataclass
class _Slot:
    buffers: list[PermuteBuffers] = field(default_factory=list)  # one per permute of a batch
    owner: int | None = None  # index of the batch that last wrote this slot
    released: torch.cuda.Event | bool = True  # event on main after the owner's last use


class BufferRing:
    """Pipeline-owned permute output buffers (P1's; P2's with ``recat="ring"``): ``depth``
    slots, batch ``i`` uses slot ``i % depth``.

    Contract: the pipeline calls :meth:`allocator` on the stream that writes the slot (data_dist,
    or the side stream of :meth:`split_runner`) for each batch's permutes (P1 in its input dist,
    P2 in its forward), and :meth:`release` on the main stream once the batch's forward, backward
    and optimizer step are queued (its last use of the slot; on several ranks main has by then
    waited on data_dist, so the all-to-all reads of the slot are covered too). Results are
    views of the slot; a slot whose memory is still used by a view when its turn comes again
    (the caller kept an earlier batch's output) gets new memory instead of being overwritten.
    ``stale_refs(t)``: references to ``t``'s memory that are known not to be read after the
    slot's release (fbgemm's TBE keeps the last batch's indices until its next forward).
    """

    def __init__(
        self, main: torch.cuda.Stream | None, depth: int,
        stale_refs: Callable[[torch.Tensor], int] = lambda t: 0,
    ) -> None:
        self._main = main
        self._slots = [_Slot() for _ in range(depth)]
        self._stale_refs = stale_refs
        #: buffers given new memory because a result of an earlier batch still used them
        self.replaced = 0

    def allocator(self, batch_index: int) -> Allocator:
        """An allocator handing out batch ``batch_index``'s k-th buffers on its k-th call."""
        slot = self._slots[batch_index % len(self._slots)]
        calls = 0

        def alloc(spec: PermuteSpec) -> PermuteBuffers:
            nonlocal calls
            k, calls = calls, calls + 1
            if slot.owner != batch_index:
                self._wait_released(slot)
                slot.owner, slot.released = batch_index, False
            if k == len(slot.buffers):
                slot.buffers.append(_grown(spec))
            elif not slot.buffers[k].fits(spec):
                slot.buffers[k] = _grown(spec)  # the old block's last reader is waited on
            elif _held_outside(slot.buffers[k], self._stale_refs):
                # Someone kept a result of an earlier batch (e.g. an EmbeddingCollection
                # output whose lengths are the permuted ones): leave that memory to them.
                slot.buffers[k] = _grown(spec)
                self.replaced += 1
            return _views(slot.buffers[k])

        return alloc

    def split_runner(
        self, batch_index: int, side: torch.cuda.Stream | None, done: list[SideWrite]
    ) -> Runner:
        """A runner for batch ``batch_index``'s permutes that keeps the slot wait off data_dist.

        The permuted lengths (what the splits all-to-all is computed from, and read on the
        host) are made on the current (data_dist) stream at once, in fresh memory; the values
        and weights go into the ring slot on ``side``, which waits for data_dist's inputs and
        for the slot's release. A :class:`SideWrite` per permute is appended to ``done``:
        data_dist must wait on its event before anything reads the values (world size 1: after
        the splits read), and the caller drops it only then (it holds the inputs, data_dist
        memory that ``side`` reads). ``side=None`` (CPU) runs both parts in order on the
        current stream.
        """
        into_slot = write_into(self.allocator(batch_index))

        def run(
            permute: torch.Tensor,
            lengths: torch.Tensor,
            values: torch.Tensor,
            weights: torch.Tensor | None,
            total: int,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            lengths_out = torch.index_select(lengths, 0, permute)
            if side is None:
                return lengths_out, *into_slot(permute, lengths, values, weights, total)[1:]
            side.wait_stream(torch.cuda.current_stream(side.device))
            with side:
                _, values_out, weights_out = into_slot(permute, lengths, values, weights, total)
                event = torch.cuda.Event()
                event.record(side)
            done.append(SideWrite(event, (permute, lengths, values, weights)))
            return lengths_out, values_out, weights_out

        return run

    def release(self, batch_index: int) -> None:
        """Batch ``batch_index`` is done with its slot once main's queued work completes."""
        slot = self._slots[batch_index % len(self._slots)]
        if slot.owner != batch_index:
            return
        if self._main is None:
            slot.released = True
        else:
            event = torch.cuda.Event()
            event.record(self._main)
            slot.released = event

    def forget_owners(self) -> None:
        """The pipeline dropped its batches and numbers them from 0 again (torchrec's
        ``reset``): a batch whose index equals a slot's last owner's must still wait for that
        owner's release (or, never released, for main's queued work)."""
        for slot in self._slots:
            slot.owner = None

    def drop_done(self) -> None:
        """Give back the memory of every slot whose last use is done: released, and its event
        on main completed (``query``: never waits). For a pipeline that stopped using the ring;
        a later :meth:`allocator` call would allocate anew. Safe because every stream that
        touched a slot (data_dist, the side stream) is ordered before main's release event."""
        for slot in self._slots:
            if not slot.buffers:
                continue
            if _done(slot.released):
                slot.buffers, slot.owner = [], None

    def _wait_released(self, slot: _Slot) -> None:
        current = None if self._main is None else torch.cuda.current_stream(self._main.device)
        if isinstance(slot.released, torch.cuda.Event):
            current.wait_event(slot.released)
        elif not slot.released and current is not None:
            # The last owner was never released (a batch dropped without finishing): order
            # after everything main has queued. Correct, if slow; does not happen in progress().
            current.wait_stream(self._main)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for slot in self._slots
            for b in slot.buffers
            for t in (b.lengths, b.values, b.weights)
            if t is not None
        )


@dataclass
class _CopySlot:
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # copy position -> bytes
    owner: int | None = None  # index of the batch that last wrote this slot
    served: set[int] = field(default_factory=set)  # the positions the owner got from the slot
    released: torch.cuda.Event | bool = True  # after the owner's last reader; False: not yet


class CopyRing:
    """Pipeline-owned memory for the host-to-device copies of the batch tensors that only the
    input dists read (the P1 inputs, which the pipeline frees early): one slot, one buffer per
    copy position (the ``k``-th ``to`` of the batch).

    Why: a copied batch belongs to the memcpy stream's pool, with data_dist and main recorded on
    it (torchrec's ``record_stream``). Freed early, its memory returns to the pool only once
    their work queued so far is done; with the host a step or more ahead of the GPU the next copy
    finds it pending and takes a new segment. Here the copy stream waits on the device for the
    event after the slot's last reader instead, and the memory is written again. The slot takes
    over the memory of the batches copied before the positions were known (sized as the ring
    sizes its buffers: :class:`HighWater` per position). One slot is enough because the early
    release ends the batch's input dists, and torchrec queues the next copy right after them.

    Contract (streams): :meth:`destination` gives the copy of batch ``i`` (on ``stream``, the
    copy stream, current during the copy). The positions served are those that the last early
    release named as P1 inputs (by index in the batch's copy order: the batch's structure is
    not checked, the release is); on its first served tensor, ``stream`` waits for the slot's
    release event. :meth:`release_early` (the input dists' reads are queued on the given
    stream) releases the slot only if every served tensor was a P1 input, and empties them
    (``set_()``), so that nothing reads a later batch's data through them. Otherwise the slot
    stays unreleased (main may read a tensor of it): torchrec copies batch ``i + 2`` before
    batch ``i``'s step ends, so that copy gets fresh memory, and :meth:`release_late` (main,
    end of the step) only matters for the last batches and :meth:`drop_done`. A slot whose
    memory someone else still holds also gets fresh memory (the old goes back to the
    allocator, which knows its streams).
    """

    def __init__(self) -> None:
        self._slot = _CopySlot()
        self._positions: frozenset[int] | None = None  # None: not learned yet
        self._sizes = HighWater()  # bytes per copy position
        #: buffers given new memory because a tensor outside the ring still used them
        self.replaced = 0
        #: copies written into memory that an earlier batch's copy used (what the ring is for)
        self.reused = 0

    def destination(self, batch_index: int, stream: torch.cuda.Stream) -> Destination:
        """Batch ``batch_index``'s destinations (call it for each batch, in copy order)."""
        slot = self._slot
        wait = slot.released
        if wait is False:  # the previous owner may still be read: leave it its memory
            slot.buffers = {}
        slot.owner, slot.served, slot.released = batch_index, set(), False
        positions = self._positions

        def into(k: int, src: torch.Tensor) -> torch.Tensor | None:
            nonlocal wait
            if not src.is_contiguous() or src.numel() == 0:
                return None  # (an empty tensor has no memory to reuse, and data pointer 0)
            size = src.numel() * src.element_size()
            if positions is None:  # before the first release: fresh memory, sized as the
                # ring's (it may take it over)
                return self._sizes.like(k, src, stream.device)
            if k not in positions:
                return None
            if not isinstance(wait, bool):  # the release event
                stream.wait_event(wait)
            wait = True
            buffer = slot.buffers.get(k)
            if buffer is not None and buffer.numel() >= size and _users(buffer) > 2:
                self.replaced += 1
                buffer = None
            if buffer is None or buffer.numel() < size:  # on the current (copy) stream
                n = self._sizes.numel(k, size)
                buffer = torch.empty(n, dtype=torch.uint8, device=stream.device)
                slot.buffers[k] = buffer
            else:
                self.reused += 1
            slot.served.add(k)
            return on_storage(buffer, src)

        return into

    def release_early(
        self, batch_index: int, made: list[torch.Tensor], inputs: set[int],
        stream: torch.cuda.Stream,
    ) -> set[int]:
        """Batch ``batch_index``'s copies ``made`` (in copy order), of which the positions whose
        storage is in ``inputs`` (data pointers) are P1 inputs, all of whose readers are queued on
        ``stream``. Learns those positions for the next batches. If every tensor the slot served
        is one of them, the slot is released (an event on ``stream``) and takes over the memory
        of the other P1 inputs where it has no buffer yet (the batches copied before the
        positions were known: their memory would otherwise stay cached beside the ring). Those
        tensors are emptied (``set_()``, ordered on ``stream``). Returns the positions whose
        memory the ring holds (also those served to a slot left for :meth:`release_late`): the
        caller must not free their storage."""
        positions = {k for k, t in enumerate(made) if t.untyped_storage().data_ptr() in inputs}
        self._positions = frozenset(positions)
        slot = self._slot
        if slot.owner != batch_index:
            return set()
        if not slot.served <= positions:  # main may read one: release_late's, left as is
            return set(slot.served)
        kept = set(slot.served)
        with stream:  # after the reads, in the sanitizer's view too
            for k in positions - kept:
                storage = None if k in slot.buffers else whole_storage(made[k])
                if storage is not None:
                    slot.buffers[k] = storage
                    kept.add(k)
            for k in kept:
                made[k].set_()
        slot.released = stream.record_event()
        return kept

    def release_late(self, batch_index: int, main: torch.cuda.Stream) -> None:
        """Batch ``batch_index``'s step is queued on ``main``: a slot it still holds is released
        once main's queued work is done."""
        slot = self._slot
        if slot.owner == batch_index and slot.released is False:
            slot.released = main.record_event()

    def drop_done(self) -> None:
        """Give back the slot's memory if its last use is done (``query``: never waits)."""
        slot = self._slot
        if slot.buffers and _done(slot.released):
            slot.buffers, slot.owner = {}, None

    def storages(self) -> set[int]:
        """The data pointers of the ring's memory."""
        return {b.untyped_storage().data_ptr() for b in self._slot.buffers.values()}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._slot.buffers.values())


def on_storage(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape at the start of ``buffer``'s storage: on the
    storage, not a view, so that emptying it later (``set_()``) keeps no reference."""
    return torch.empty(0, dtype=like.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), 0, like.shape
    )


def whole_storage(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s whole storage as a byte tensor (for a ring to take its memory over), or None
    where ``t`` is not contiguous from the storage's start."""
    if not _from_start(t):
        return None
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


# The view forms of the two above, for memory that other streams use while the tensor is
# made (the permuted copy's slot): the CUDA sanitizer counts a ``set_`` as a write on the
# current stream, though it launches nothing, and a view as metadata only. A view keeps its
# base alive, so the copy ring, which counts a storage's holders, keeps the ``set_`` forms.
def front_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A view of ``like``'s dtype and shape at the front of the byte tensor ``buffer``."""
    return buffer[: like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def whole_view(t: torch.Tensor) -> torch.Tensor | None:
    """A byte view of ``t``'s whole storage, or None where ``t`` is not contiguous from the
    storage's start."""
    if not _from_start(t):
        return None
    return t.reshape(-1).view(torch.uint8).as_strided((t.untyped_storage().nbytes(),), (1,))


def _from_start(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0


def _done(released: torch.cuda.Event | bool) -> bool:
    return released if isinstance(released, bool) else released.query()


def _users(t: torch.Tensor) -> int:
    """Owners of ``t``'s storage: ``t``, the storage object made for this call, others."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _views(buffers: PermuteBuffers) -> PermuteBuffers:
    """New tensors on the same memory: the ring keeps its own tensors to itself, so that any
    live tensor on a slot's storage beyond them is a result someone still holds."""
    return PermuteBuffers(
        *(None if t is None else t.detach() for t in (buffers.lengths, buffers.values, buffers.weights))
    )


def _held_outside(buffers: PermuteBuffers, stale_refs: Callable[[torch.Tensor], int]) -> bool:
    """Whether a tensor other than the ring's own and the ``stale_refs`` still uses
    ``buffers``' memory."""
    # The storage's owners: the ring's tensor, the storage object made for this call, the
    # stale references, others (:func:`_users`).
    for t in (buffers.lengths, buffers.values, buffers.weights):
        if t is not None:
            users = _users(t)
            if users > 2 and users > 2 + stale_refs(t):  # (counted only when needed)
                return True
    return False


def _grown(spec: PermuteSpec) -> PermuteBuffers:
    """Buffers for ``spec`` with headroom on the values, allocated on the current stream."""
    return allocate(
        PermuteSpec(
            spec.lengths_shape, spec.lengths_dtype, _with_headroom(spec.num_values),
            spec.values_dtype, spec.weights_dtype, spec.device,
        )
    )
