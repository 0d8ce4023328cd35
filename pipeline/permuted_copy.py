"""The permuted copy: a batch's P1 input values land on the device already in P1's order.

With more than one rank, the feature-order permute of an EmbeddingBagCollection's input dist
(P1) feeds only the all-to-all, and what it writes is a second copy of the batch's values: the
copy, P1's output and the all-to-all's outputs are three batch-sized tensors in flight across
the previous batch's backward, where ``TrainPipelineBase`` holds two. :class:`PermutedCopy`
writes the host-to-device copy of one KJT's values (and weights) in P1's feature order (one
block per feature, :func:`write_permuted`), into one pipeline-owned slot, so that P1 permutes
the lengths alone and the all-to-all sends the copy itself.

The slot is read by the all-to-all, which torchrec queues a step after the copy (in
``wait_sparse_data_dist``), so the next batch's copy into the slot waits for it: the host
defers that copy until the all-to-all's sends are done (:meth:`PermutedCopy.sent`) and the copy
stream waits on their event on the device.

Contract (the pipeline calls, per batch, in torchrec's order):

- :meth:`~PermutedCopy.destination` for the batch's copy, then :meth:`~PermutedCopy.copied`.
- :meth:`~PermutedCopy.runner` for its P1 calls (``plannable``: the module is an
  EmbeddingBagCollection), then :meth:`~PermutedCopy.learned`.
- :meth:`~PermutedCopy.wait` on the stream that reads its values (data_dist): before the
  all-to-all, after the host's splits read; before P1 where the write was not in P1's order
  (:meth:`~PermutedCopy.in_order`) or a row-wise group bucketizes the values there.
- :meth:`~PermutedCopy.sent` once every all-to-all that read its values is done (an event on
  data_dist), :meth:`~PermutedCopy.forget` at the end of its step.

Only the input dists may read the copied values (the contract of ``MemoryPlan.free_inputs``), and
each only through P1 and the all-to-all: no data-parallel table, no EmbeddingCollection (whose
context keeps P1's output for the main stream), no pipelined postproc. The pipeline checks the
plan for that. The batch's structure (its tensors in copy order) is the same from batch to
batch, as torchrec's pipelined forward assumes; a planned tensor of another dtype or rank is
copied as torchrec does.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch

from recpipe.kjt import Destination, Later, Runner
from recpipe.ops import PermuteResult
from recpipe.pipeline.buffers import HighWater, front_view, whole_view


class _Plan(NamedTuple):
    """Where a planned KJT's tensors are in the batch's copy order, and P1's permute of it."""

    lengths: int
    values: int
    weights: int | None
    permute: torch.Tensor  # what torchrec passes each batch (the module's own tensor)
    order: tuple[int, ...]  # its values, on the host
    dtypes: dict[int, torch.dtype]  # of the values and weights, by position


class _Copy(NamedTuple):
    """A batch's copy into the slot: host sources and device destinations by position."""

    index: int
    sources: dict[int, torch.Tensor]
    targets: dict[int, torch.Tensor]


def write_permuted(
    lengths: torch.Tensor | None, sources: Sequence[torch.Tensor | None],
    targets: Sequence[torch.Tensor | None], order: Sequence[int],
) -> bool:
    """Copy each of ``sources`` (values, weights: one block per feature, the features being the
    rows of ``lengths`` [F * B] on the host) into the matching target, the blocks in ``order``
    (block ``j`` of a target is block ``order[j]`` of its source), on the current stream.
    If ``lengths`` does not describe the sources (F rows, summing to their length) or is None,
    the sources are copied as they are; returns whether they were permuted."""
    rows = len(order)
    fits = lengths is not None and lengths.numel() % rows == 0
    sizes = lengths.reshape(rows, -1).sum(1).tolist() if fits else None
    permuted = sizes is not None and all(
        s is None or sum(sizes) == s.numel() for s in sources
    )
    for source, target in zip(sources, targets):
        if source is None or target is None:
            continue
        if not permuted:
            target.copy_(source, non_blocking=True)
            continue
        blocks = source.split(sizes)
        torch._foreach_copy_(
            list(target.split([sizes[k] for k in order])), [blocks[k] for k in order],
            non_blocking=True,
        )
    return permuted


class PermutedCopy:
    """One slot for the P1-ordered copy of one KJT per batch (module docstring).

    ``stream``: the stream that writes the slot (CUDA: a side stream, so that data_dist's wait
    for the memcpy stream does not cover it; the pipeline makes data_dist wait for the write
    where the values are read); None on CPU, where the writes are synchronous.
    """

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._plan: _Plan | None = None
        # the batch being learned: values' data pointer -> (bytes, plan); None: not plannable
        self._candidates: dict[int, tuple[int, _Plan] | None] = {}
        self._learning: list[torch.Tensor] | None = None  # the copies of the batch being learned
        self._sizes = HighWater()  # bytes per copy position
        self._slot: dict[int, torch.Tensor] = {}  # copy position -> bytes
        self._owner: int | None = None  # whose data the slot holds, still to be sent
        self._sent: torch.cuda.Event | None = None  # after the last owner's sends
        self._pending: _Copy | None = None  # the next copy, waiting for the owner's sends
        self._copies: dict[int, _Copy] = {}  # batch -> its copy, from destination() to copied()
        self._written: dict[int, torch.cuda.Event | None] = {}  # batch -> after its write
        self._permuted: dict[int, int] = {}  # batch -> data pointer of its P1-ordered values
        self._consumed: set[int] = set()  # batches whose P1-ordered values a P1 took
        #: whether the module whose input dist runs now may be planned (an EmbeddingBagCollection)
        self.plannable = False
        #: whether the next batch's P1 is observed for a plan (the first batch's only)
        self.planning = True
        #: batches copied in P1's order
        self.batches = 0

    def destination(self, index: int) -> Destination:
        """Batch ``index``'s destinations (:func:`recpipe.kjt.copy_batch`, on the copy stream):
        the planned values and weights into the slot, unwritten (:class:`~recpipe.kjt.Later`),
        the rest fresh; all fresh while the previous copy still waits. Before a plan, on CUDA,
        every tensor is sized as the slot would be, so that the slot can take over the memory
        of the one it plans (:meth:`learned`): else that batch-sized block would stay cached
        in the copy stream's pool beside the slot."""
        plan = self._plan
        if self._pending is not None or plan is None and (not self.planning or self._stream is None):
            return _fresh
        if plan is None:
            return self._sized
        copy = self._copies[index] = _Copy(index, {}, {})
        planned = {plan.lengths, plan.values, plan.weights}

        def into(k: int, src: torch.Tensor) -> Later | None:
            if k not in planned:
                return None
            copy.sources[k] = src
            if k == plan.lengths or src.dtype != plan.dtypes[k] or src.dim() != 1:
                return None
            size = src.numel() * src.element_size()
            buffer = self._slot.get(k)
            if buffer is None or buffer.numel() < size:  # the owner keeps its old memory
                device = src.device if self._stream is None else self._stream.device
                buffer = torch.empty(self._sizes.numel(k, size), dtype=torch.uint8, device=device)
                self._slot[k] = buffer
                if self._stream is not None:  # (allocated on the copy stream)
                    self._stream.wait_stream(torch.cuda.current_stream(device))
            copy.targets[k] = front_view(buffer, src)
            return Later(copy.targets[k])

        return into

    def copied(self, index: int) -> None:
        """Batch ``index``'s copy is made: write the slot now if it is free, else once the
        owner's sends are done (:meth:`sent`)."""
        copy = self._copies.pop(index, None)
        if copy is None or not copy.targets:
            return
        if self._owner is None:
            self._write(copy)
        else:
            self._pending = copy

    def blocking(self, index: int) -> int | None:
        """The owner whose sends batch ``index``'s copy still waits for (None: written)."""
        pending = self._pending
        return self._owner if pending is not None and pending.index == index else None

    def sent(self, index: int, event: torch.cuda.Event | None) -> None:
        """Every all-to-all that read batch ``index``'s values is done (``event``, recorded on
        the stream that waited for them; None on CPU): the next copy may write the slot."""
        if self._owner != index:
            return
        self._owner, self._sent = None, event
        pending, self._pending = self._pending, None
        if pending is not None:
            self._write(pending)

    def in_order(self, index: int) -> bool:
        """Whether batch ``index``'s slot was written in P1's order (or it has no slot write):
        else P1 reads the slot as the values, and must wait for the write (:meth:`wait`)."""
        return index in self._permuted or index not in self._written

    def check(self, index: int) -> None:
        """After batch ``index``'s input dists: its values in P1's order must have reached a P1
        (:meth:`runner`), else torchrec permuted them otherwise (e.g. a KJT of variable stride
        per key): a one-line error rather than wrong values."""
        if index in self._permuted and index not in self._consumed:
            raise RuntimeError(_PERMUTED_OTHERWISE)

    def wait(self, index: int, stream: torch.cuda.Stream | None) -> None:
        """``stream`` (the values' reader) waits for batch ``index``'s write."""
        event = self._written.get(index)
        if event is not None and stream is not None:
            stream.wait_event(event)

    def _sized(self, k: int, src: torch.Tensor) -> torch.Tensor | None:
        """Before a plan: fresh memory on the current stream, sized as the slot's."""
        return None if src.numel() == 0 else self._sizes.like(k, src, self._stream.device)

    def runner(self, index: int, inner: Runner, copies: list[torch.Tensor]) -> Runner:
        """Batch ``index``'s P1 runner: for its P1-ordered values, the lengths are permuted
        and the values are the slot's; every other permute is ``inner``'s. Before a plan, it
        notes the candidates (``copies``: the batch's copied tensors, in copy order)."""
        values_at = self._permuted.get(index)
        plan = self._plan
        learning = self.planning
        if learning:
            self._learning = copies

        def run(
            permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
            weights: torch.Tensor | None, total: int,
        ) -> PermuteResult:
            if values_at is not None and values.data_ptr() == values_at:
                assert plan is not None
                if permute is not plan.permute or lengths.shape[0] != len(plan.order):
                    raise RuntimeError(_PERMUTED_OTHERWISE)
                self._consumed.add(index)
                return torch.index_select(lengths, 0, permute), values, weights
            if learning:
                self._note(permute, lengths, values, weights, total)
            return inner(permute, lengths, values, weights, total)

        return run

    def exclude(self, values: torch.Tensor) -> None:
        """A KJT with these values is also sent as it is (an input dist that did not permute
        it): never planned, since that all-to-all would send the values in another P1's
        order."""
        if self.planning:
            self._candidates[values.data_ptr()] = None

    def learned(self, index: int, reader: torch.cuda.Stream | None) -> None:
        """End of batch ``index``'s P1 calls (queued on ``reader``): plan the largest KJT that
        one plannable P1 permuted whole, if any (once). The slot takes over the memory of its
        values and weights (the next write waits for the P1 on ``reader``)."""
        if not self.planning:
            return
        candidates, self._candidates = self._candidates, {}
        copies, self._learning = self._learning or [], None
        self.planning = False
        plans = [c for c in candidates.values() if c is not None]
        if not plans:
            return
        plan = self._plan = max(plans, key=lambda c: c[0])[1]
        if self._stream is None:
            return
        for k in (plan.values, plan.weights):
            storage = None if k is None else whole_view(copies[k])
            if storage is not None:
                self._slot[k] = storage
        self._sent = reader.record_event() if reader is not None else None
        self._written[index] = None  # (its slot positions are not to be freed)

    def forget(self, index: int) -> None:
        """Batch ``index``'s step is queued: drop what was kept for it."""
        self._written.pop(index, None)
        self._permuted.pop(index, None)
        self._consumed.discard(index)

    def reset(self) -> None:
        """The pipeline dropped its batches (torchrec's ``reset``): their copies, and the slot's
        owner, whose all-to-all was issued and waited (:meth:`sent`) or never will be; the
        next write still waits for the last sends' event."""
        self._pending, self._owner = None, None
        self._copies.clear()
        self._written.clear()
        self._permuted.clear()
        self._consumed.clear()

    def positions(self, index: int) -> set[int]:
        """The copy positions of batch ``index`` that are the slot's (never to be freed)."""
        plan = self._plan
        if plan is None or index not in self._written:
            return set()
        return {k for k in (plan.values, plan.weights) if k is not None}

    def _note(
        self, permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
        weights: torch.Tensor | None, total: int,
    ) -> None:
        """A P1 of the batch being learned: a candidate if plannable, whole, and of the
        pipeline's own copies; a KJT permuted twice is none."""
        key = values.data_ptr()
        if key in self._candidates:
            self._candidates[key] = None
            return
        copies = self._learning or ()
        # the copies themselves, whole (not views into a packed one)
        at = {(t.data_ptr(), t.numel()): k for k, t in enumerate(copies) if t.numel()}
        whole = total == values.numel() and permute.numel() == lengths.shape[0] and values.dim() == 1
        found = [
            None if t is None else at.get((t.data_ptr(), t.numel()))
            for t in (lengths, values, weights)
        ]
        if not self.plannable or not whole or found[0] is None or found[1] is None or (
            weights is not None and found[2] is None
        ):
            self._candidates[key] = None
            return
        order = tuple(permute.tolist())
        if sorted(order) != list(range(len(order))):
            self._candidates[key] = None
            return
        nbytes = values.nbytes + (0 if weights is None else weights.nbytes)
        dtypes = {found[1]: values.dtype}
        if weights is not None:
            dtypes[found[2]] = weights.dtype
        self._candidates[key] = (nbytes, _Plan(found[0], found[1], found[2], permute, order, dtypes))

    def _write(self, copy: _Copy) -> None:
        """Write ``copy`` into the slot (after the last owner's sends); it becomes the owner."""
        plan = self._plan
        assert plan is not None
        stream = self._stream
        values, weights = plan.values, plan.weights
        # every planned tensor in the slot, or none is written in P1's order
        whole = all(k in copy.targets for k in (values, weights) if k is not None)
        with _on(stream):
            if stream is not None and self._sent is not None:
                stream.wait_event(self._sent)
            permuted = write_permuted(
                copy.sources.get(plan.lengths) if whole else None,
                [copy.sources.get(values), copy.sources.get(weights)],
                [copy.targets.get(values), copy.targets.get(weights)],
                plan.order,
            )
            self._written[copy.index] = None if stream is None else stream.record_event()
        self._owner = copy.index
        if permuted and copy.targets[values].numel():  # (empty: nothing to tell apart)
            self._permuted[copy.index] = copy.targets[values].data_ptr()
            self.batches += 1


_PERMUTED_OTHERWISE = (
    "recpipe: a KJT copied in its P1 order was permuted otherwise (did its keys, its stride "
    "per key or the model change?); set memory_plan = MemoryPlan(free_inputs=False)"
)


def _fresh(k: int, src: torch.Tensor) -> None:
    """A destination that copies into fresh memory (and has the copy noted, on CPU too)."""
    return None


def _on(stream: torch.cuda.Stream | None):
    """``stream`` current in the block (nothing on CPU)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)
