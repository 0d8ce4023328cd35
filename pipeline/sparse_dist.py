"""``TrainPipelineSparseDist`` with the input path's batch-sized tensors in memory that is
reusable on time.

A drop-in subclass of torchrec's pipeline: same constructor, same ``progress()``. It changes only
where the batch-sized tensors of the sparse input distribution live, as its resolved
:class:`~recpipe.pipeline.plan.Placements` say (``plan``): the table of tensors, streams and
reuse events is :mod:`recpipe.pipeline.plan`'s; the memory is :mod:`recpipe.pipeline.buffers`' rings
and sizes and :mod:`recpipe.pipeline.permuted_copy`'s slot; each hook's place in torchrec's
``progress()``: docs/hot_path.md. What the all-to-alls sent is dropped on data_dist once the
all-to-all is waited, not a step later at the forward (:meth:`_release_sent_inputs`).

How the permutes are reached: Python runs at P1 and P2 only. The batch's KJTs take a
per-pipeline subclass (:func:`recpipe.kjt.redirecting_kjt_type`) during each pipelined module's
``input_dist`` (P1: its ``permute``), and the all-to-all inputs take it during the input-dist
wait (P2: its ``dist_init``); torchrec's own methods run inside, with a
:class:`~recpipe.kjt.PermuteInto` mode whose scope is that one method. Every other torch call of
the input dist takes torch's C++ path, and nothing outside this pipeline's calls changes.

None of these needs ``record_stream`` (torchrec still calls it on the KJT; for main-stream memory
it is a no-op, and pipeline-owned memory is written again only after its last reader's event);
the split permute's lengths (small, fresh data_dist memory) do rely on it. Everything else is
torchrec's code path, so the losses are bit-identical: recpipe's permute gives fbgemm's results
exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.train_pipeline.pipeline_context import In, Out, TrainPipelineContext
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSparseDist as _TorchrecTrainPipelineSparseDist,
)
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.kjt import (
    Allocator,
    PermuteBuffers,
    PermuteSpec,
    RedirectStats,
    Runner,
    allocate,
    as_type,
    copy_batch,
    kjt_nbytes,
    kjt_tensors,
    redirecting_kjt_type,
    release_storage,
    write_into,
)
from recpipe.pipeline.buffers import (
    AllToAllOutputs,
    BufferRing,
    CopyRing,
    HighWater,
    SideWrite,
    main_stream_allocator,
    padded_allocator,
)
from recpipe.pipeline.permuted_copy import PermutedCopy
from recpipe.pipeline.plan import Facts, MemoryPlan, Placements, resolve
from recpipe.pipeline.compat import (
    all_to_all_awaitables,
    all_to_all_input,
    async_copy_executor,
    clears_data_dist_inputs,
    copies_or_frees_inputs_itself,
    drop_cached_views,
    release_all_to_all_input,
    dist_init_on_main_stream,
    pipeline_options,
    stale_index_refs,
)


@dataclass
class PipelineStats(RedirectStats):
    """Counts since the pipeline was made: permutes redirected at P1 (``input_dist``) and P2
    (``dist_init``), torch calls the interception saw (``seen``), all-to-alls whose sent inputs
    went a step early (``released``), bytes of input KJTs freed early (``inputs_freed_bytes``),
    all-to-all outputs sized to their high-water mark (``outputs_sized``), batches copied in P1's
    order (``permuted_copies``), input dists started after the forward (``late_input_dists``)."""

    released: int = 0
    inputs_freed_bytes: int = 0
    outputs_sized: int = 0
    permuted_copies: int = 0
    late_input_dists: int = 0


class TrainPipelineSparseDist(_TorchrecTrainPipelineSparseDist[In, Out]):
    """torchrec's ``TrainPipelineSparseDist``, with the batch-sized tensors of the input path
    placed by its resolved :class:`~recpipe.pipeline.plan.Placements` (module docstring). Same
    arguments and behaviour; the arguments are torchrec's (``free_features_storage_early`` and
    ``clear_data_dist_inputs`` are not in torchrec 1.6, ``async_inplace_copy`` needs 1.9).
    """

    #: What the user chooses of the memory plan; a field left None takes the model's default
    #: (:func:`recpipe.pipeline.plan.resolve`; the resolved placements: ``plan``).
    memory_plan: MemoryPlan = MemoryPlan()
    # placements chosen over the model's defaults: tests and ablations, not a product option
    _placements: Placements = Placements()
    #: Act only where it pays: below this many bytes of the first batch's P1 inputs (the input
    #: KJTs that the pipelined modules' input dists permute), the plan saves less memory than its
    #: host time is worth. Then at world size 1 the pipeline runs torchrec's code path from the
    #: next batch on (``redirecting`` False; where the first batch's whole copy is below it, from
    #: that batch on: no first use of recpipe's kernels), and at world size > 1, where the
    #: all-to-all outputs are high-water sized, the high-water sizes, the permuted copy and
    #: P2's placement (unless ``_placements`` sets it) turn off (torchrec's P2). 0: always act.
    min_batch_bytes: int = 64 * 2**20

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[In | None], tuple[torch.Tensor, Out]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
    ) -> None:
        super().__init__(
            model, optimizer, device,
            **pipeline_options(
                execute_all_batches=execute_all_batches,
                apply_jit=apply_jit,
                context_type=context_type,
                pipeline_postproc=pipeline_postproc,
                custom_model_fwd=custom_model_fwd,
                dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
                enqueue_batch_after_forward=enqueue_batch_after_forward,
                enable_inplace_copy_batch=enable_inplace_copy_batch,
                free_features_storage_early=free_features_storage_early,
                clear_data_dist_inputs=clear_data_dist_inputs,
                async_inplace_copy=async_inplace_copy,
            ),
        )
        limit = self.min_batch_bytes
        if type(limit) is not int or limit < 0:
            raise ValueError(
                f"min_batch_bytes must be an int >= 0 (bytes; 0: always act), got {limit!r}"
            )
        if not isinstance(self.memory_plan, MemoryPlan):
            raise ValueError(f"memory_plan must be a recpipe.pipeline.MemoryPlan, got {self.memory_plan!r}")
        cuda = self._device.type == "cuda"
        main = torch.cuda.current_stream(self._device) if cuda else None
        world = _world_size(self._model)
        facts = Facts(
            world, cuda, frozenset(_sharding_types(self._model)),
            torchrec_copies_or_frees=copies_or_frees_inputs_itself(self),
            torchrec_clears=clears_data_dist_inputs(self),
            postproc=bool(getattr(self, "_pipeline_postproc", False)),
            p2_on_main=dist_init_on_main_stream(),
        )
        plan = resolve(self.memory_plan, facts, self._placements)
        #: the resolved placements (``memory_plan`` with the model's defaults filled in); the
        #: first batch may turn parts of them off (``min_batch_bytes``, ``redirecting``)
        self.plan: Placements = plan
        self._bucketized = facts.bucketized
        self._use_ring = plan.p1 in ("ring", "split_ring")
        self._split_p1 = plan.p1 == "split_ring"
        if self._split_p1:
            self._side = torch.cuda.Stream(self._device, priority=-1) if cuda else None
            self._values_done: dict[int, list[SideWrite]] = {}
        stale = stale_index_refs(self._model)
        self._ring = BufferRing(main, 2 if self._split_p1 else 3, stale_refs=stale)
        several = world > 1
        # recat="ring": P2's outputs in one pipeline slot (empty otherwise); the next batch's P2
        # runs in its forward, queued after this batch's backward, whose end releases the slot
        self._recat_ring = BufferRing(main, 1, stale_refs=stale)
        #: what the pipeline did so far (:class:`PipelineStats`)
        self.stats = PipelineStats()
        # P2, the recat after the all-to-all (more than one rank), where the plan places it
        self._redirect_dist_init = several and plan.recat != "torchrec"
        self._p2_moved_said = False  # (warned that torchrec's flag moved P2 to main since)
        self._release_sent = several  # what the all-to-alls sent goes a step early
        self._main = main
        self._input_dist_runner: Runner | None = None  # P1's, for the batch in input dist
        self._received_sizes = HighWater() if several and plan.received == "high_water" else None
        self._sent_sizes = HighWater() if several and plan.p1 == "high_water" else None
        # the defaults that pay only for large batches: decided on the first one
        self._sizes_undecided = self._received_sizes is not None and self.min_batch_bytes > 0
        self._dist_init_runner: Runner = self._recat_runner()
        self._free_inputs = plan.free_inputs
        self._copy_ring_on = plan.inputs == "ring"  # batches may have been copied into it
        self._use_copy_ring = self._copy_ring_on  # batches are copied into it from now on
        self._permuted = (
            PermutedCopy(torch.cuda.Stream(self._device) if cuda else None)
            if plan.inputs == "permuted" else None
        )
        self._sends_released: set[int] = set()  # batches whose all-to-all inputs went
        # the P1 buffers (main's pool) of the batch the permuted copy learns from, until sent
        self._learned_from: dict[int, list[PermuteBuffers]] = {}
        self._copy_ring = CopyRing()
        self._permuted_inputs: list[KeyedJaggedTensor] = []  # P1's inputs, batch in input dist
        self._sent_whole: list[KeyedJaggedTensor] = []  # input KJTs an input dist did not permute
        self._kjt_type = redirecting_kjt_type(
            lambda: self._input_dist_runner, lambda: self._dist_init_runner, self.stats,
            self._permuted_inputs.append,
        )
        acts = self._use_ring or self._free_inputs or several or self._permuted is not None
        #: Whether recpipe's plan acts: None until the first batch's input dist decides
        #: (world size 1, ``min_batch_bytes``); False where it never does (one CPU rank) or once
        #: the first batch was below ``min_batch_bytes`` (torchrec's code path since).
        self.redirecting: bool | None = (
            None if acts and world == 1 and self.min_batch_bytes > 0 else acts
        )
        # batch index -> its P1 inputs and the copy positions the copy ring took back
        self._releasable: dict[int, tuple[list[KeyedJaggedTensor], set[int] | None]] = {}
        # batch index -> the tensors its copy made (filled by torchrec's async_inplace_copy
        # worker, if on, before the batch is read)
        self._copied: dict[int, list[torch.Tensor]] = {}
        self._late_input_dist = plan.input_dist == "after_forward"
        # the next batch's input dist, deferred by start_sparse_data_dist to its wait, with the
        # memcpy stream's event after the batch's copy (None on CPU)
        self._late: tuple[In, TrainPipelineContext, torch.cuda.Event | None] | None = None
        self._step_aside_if_done()

    def start_sparse_data_dist(self, batch: In | None, context: TrainPipelineContext) -> None:
        # Every input dist starts here, the first batch's too (torchrec 1.6 and 1.8 call it
        # from _pipeline_model); torchrec switches to data_dist inside.
        if (self._late_input_dist and batch is not None and self.contexts
                and self.contexts[0] is not context):
            # started by its wait, after the forward of contexts[0]; torchrec's progress()
            # queues batch i+2's copy in between
            copied = None if self._memcpy_stream is None else self._memcpy_stream.record_event()
            self._late = (batch, context, copied)
            return
        self._start_input_dist(batch, context)

    @contextmanager
    def _copy_waited(self, batch: In, copied: torch.cuda.Event | None) -> Iterator[None]:
        """Within the block, torchrec's start of ``batch``'s input dist makes data_dist wait for
        ``copied`` (recorded on memcpy after ``batch``'s copy), not for the whole memcpy stream,
        which by then holds batch i+2's copy too. As torchrec does, ``batch`` is recorded on
        data_dist first: ``free_inputs`` gives its storages back inside the block."""
        if copied is None:
            yield
            return
        self._data_dist_stream.wait_event(copied)
        batch.record_stream(self._data_dist_stream)
        memcpy, self._memcpy_stream = self._memcpy_stream, None  # its wait_stream: a no-op
        try:
            yield
        finally:
            self._memcpy_stream = memcpy

    def _start_input_dist(self, batch: In | None, context: TrainPipelineContext) -> None:
        if self._release_sent and self.contexts and self.contexts[0] is not context:
            self._release_sent_inputs(self.contexts[0])
        copied = self._copied.get(context.index)  # (None or []: not copied by this pipeline)
        if copied and (self.redirecting is None or self._sizes_undecided):
            size = _nbytes(copied)  # its P1 inputs are at most its copy
            if size < self.min_batch_bytes:  # decided now: torchrec's path for this batch too
                self._decide(size)
        permuted = self._permuted
        acts = (self._use_ring or self._free_inputs or self._sent_sizes is not None
                or permuted is not None)
        if batch is None or not acts:
            return super().start_sparse_data_dist(batch, context)
        self._input_dist_runner = None
        if self._use_ring:
            self._input_dist_runner = self._ring_runner(context.index)
        elif self._sent_sizes is not None:
            self._input_dist_runner = write_into(padded_allocator(self._sent_sizes))
        if permuted is not None:
            owner = permuted.blocking(context.index)
            if owner is not None:  # (not in torchrec's order: its wait comes first)
                self._sends_done(owner)
            # P1 reads the slot as the values (a write not in P1's order), or a row-wise
            # group bucketizes them, before the splits' host read
            if self._bucketized or not permuted.in_order(context.index):
                permuted.wait(context.index, self._data_dist_stream)
            inner = self._input_dist_runner or write_into(allocate)
            if permuted.planning:  # this batch alone has a batch-sized P1 output: see _kept
                inner = write_into(_kept(self._main, self._learned_from.setdefault(context.index, [])))
            self._input_dist_runner = permuted.runner(
                context.index, inner, self._copied.get(context.index, [])
            )
        try:
            with self._input_dists_redirected():
                super().start_sparse_data_dist(batch, context)
            noted = list(self._permuted_inputs)  # P1's inputs
            whole = {id(k) for k in self._sent_whole}
        finally:  # (also when an input dist raised: not the next batch's)
            self._permuted_inputs.clear()
            self._sent_whole.clear()
        free = self._free_inputs  # this batch's, whatever the decision says of the next ones
        if self.redirecting is None or self._sizes_undecided:
            self._decide(_nbytes({id(k): k for k in noted}.values()), sizes=bool(noted))
        # an input KJT that another input dist sends as it is: neither freed nor planned
        inputs = [k for k in noted if id(k) not in whole]
        if self._permuted is not None:
            for kjt in noted:
                if id(kjt) in whole:
                    self._permuted.exclude(kjt.values())
            self._permuted.check(context.index)
            self._permuted.learned(context.index, self._data_dist_stream)
        if not free:
            return
        if not self._split_p1:
            self._release_inputs(context.index, inputs)
            return
        served = None  # the side stream reads them: after data_dist's wait for it, but
        if self._copy_ring_on and self._side is not None:
            self._side.wait_stream(self._data_dist_stream)  # the copy ring's now, on the side
            served = self._release_copies(context.index, inputs, self._side)
            self._unpin_ring(self._values_done.get(context.index, []))
        self._releasable[context.index] = (inputs, served)

    def _decide(self, size: int, sizes: bool = True) -> None:
        """The first batch's P1 inputs took ``size`` bytes (after its input dist; before it, its
        whole copy, an upper bound: then that batch takes torchrec's path too). Below
        ``min_batch_bytes`` the next batches take torchrec's path at world size 1, and the
        high-water sizes (P1, the all-to-all outputs), the permuted copy and P2's placement
        (unless set) turn off (``sizes=False``: no P1 ran, a later batch decides them). Batches
        in flight finish what they started (side writes, ring slots and early frees: by batch)."""
        pays = size >= self.min_batch_bytes
        if self._sizes_undecided and sizes:
            if not pays:
                self._sent_sizes = self._received_sizes = self._permuted = None
                self._redirect_dist_init &= self._placements.recat is not None  # or torchrec's P2
                self._dist_init_runner = self._recat_runner()
            self._sizes_undecided = False
        if self.redirecting is None:
            self.redirecting = pays
            if not pays:
                self._use_ring = self._free_inputs = self._use_copy_ring = False

    def _recat_runner(self) -> Runner:
        """P2's runner for ``recat`` in main's pool: buffers sized to their site's high-water
        mark where the plan says (by default with row-wise tables, while the all-to-all outputs
        are sized), else exact (main's pool shares P2's blocks with the activations). Unused
        with ``"ring"`` (a runner per batch), ``"torchrec"`` and once P2's placement is off."""
        chosen = self._placements.recat is not None or self._received_sizes is not None
        sized = self.plan.recat == "high_water" and chosen and self._redirect_dist_init
        alloc = padded_allocator(HighWater(), by_call=False) if sized else allocate
        return write_into(main_stream_allocator(self._main, alloc))

    def _before_recat(self, index: int, runner: Runner | None) -> None:
        """Before each P2 of batch ``index`` (in its forward): the batch the permuted copy learned
        from drops its P1 output (main's pool: earlier, small tensors would split the block P2's
        output needs); the batch's recat-ring runner takes over."""
        self._learned_from.pop(index, None)
        if runner is not None:
            self._dist_init_runner = runner

    def _release_copies(self, index: int, inputs: list[KeyedJaggedTensor],
                        stream: torch.cuda.Stream) -> set[int]:
        """Give batch ``index``'s P1 inputs that the copy ring served back to the ring (every
        reader of them is queued on ``stream`` or ordered before it); returns their copy
        positions. Cached views of the inputs (``to_dict()``'s) are dropped first: they would
        keep the memory (torchrec validates each module's first batch with ``to_dict()``)."""
        kjts = {id(k): k for k in inputs}.values()
        for kjt in kjts:
            drop_cached_views(kjt)
        if not self._copy_ring_on:  # (on for batches copied before a decision turned it off)
            return set()
        storages = {t.untyped_storage().data_ptr() for kjt in kjts for t in kjt_tensors(kjt)}
        storages.discard(0)  # (empty tensors)
        return self._copy_ring.release_early(index, self._copied.get(index, []), storages, stream)

    def _unpin_ring(self, writes: list[SideWrite]) -> None:
        """The side writes keep their inputs alive until data_dist has waited on them; the copy
        ring's memory is guarded by the ring's event instead: let go of it, or the next copy
        would see it held and take new memory."""
        ring = self._copy_ring.storages()
        writes[:] = [w._replace(inputs=tuple(t for t in w.inputs if t is not None
                                             and t.untyped_storage().data_ptr() not in ring))
                     for w in writes]

    def _release_inputs(self, index: int, inputs: list[KeyedJaggedTensor],
                        served: set[int] | None = None) -> None:
        """Free the storage of batch ``index``'s P1 inputs that the pipeline's own copy made
        (never a user's tensors). Every reader is queued on data_dist (torchrec recorded the
        batch there) or ordered before it (the split permute's side stream). What the copy ring
        served goes back to the ring (``served``: the positions it took back, else here)."""
        if served is None:
            served = self._release_copies(index, inputs, self._data_dist_stream)
        if self._permuted is not None:
            served = served | self._permuted.positions(index)
        made = self._copied.get(index, [])
        owned = {t.untyped_storage().data_ptr() for k, t in enumerate(made) if k not in served}
        for kjt in {id(k): k for k in inputs}.values():
            self.stats.inputs_freed_bytes += release_storage(kjt, owned)

    def copy_batch_to_gpu(
        self, dataloader_iter: Iterator[In]
    ) -> tuple[In | None, TrainPipelineContext | None]:
        """torchrec's copy on the memcpy stream, noting which tensors it made (to free early),
        and the permuted copy's."""
        if not self._free_inputs and self._permuted is None:
            return super().copy_batch_to_gpu(dataloader_iter)
        return self._copy_next(dataloader_iter, inplace=False)

    def inplace_copy_batch_to_gpu(
        self, dataloader_iter: Iterator[In]
    ) -> tuple[In | None, TrainPipelineContext | None]:
        """torchrec's, for any ``Pipelineable`` (no ``data_copy_stream`` argument needed): the
        batch is allocated on main and copied on the memcpy stream (torchrec's
        ``_wait_for_batch`` makes main wait on it before the forward). With torchrec 1.9's
        ``async_inplace_copy``, dispatched by its worker thread as torchrec's is."""
        return self._copy_next(dataloader_iter, inplace=True)

    def _copy_next(
        self, dataloader_iter: Iterator[In], inplace: bool
    ) -> tuple[In | None, TrainPipelineContext | None]:
        context = self._create_context()
        batch = self._next_batch(dataloader_iter)
        if batch is not None:
            made: list[torch.Tensor] = []
            if self.redirecting is not False:  # (once the plan is off, nothing reads it)
                self._copied[context.index] = made
            executor = async_copy_executor(self) if inplace else None
            if executor is not None:  # the worker allocates on this thread's current stream
                # (streams read here: a deferred input dist hides memcpy while the worker runs)
                copy = partial(copy_batch, batch, self._device, self._memcpy_stream, made, inplace=True)
                return executor.submit(_on_stream, torch.cuda.current_stream(self._device), copy), context
            into = None
            if self._permuted is not None and not inplace:
                into = self._permuted.destination(context.index)
            elif self._use_copy_ring and not inplace:
                into = self._copy_ring.destination(context.index, self._memcpy_stream)
            batch = copy_batch(batch, self._device, self._memcpy_stream, made, inplace, into)
            if self._permuted is not None:
                self._permuted.copied(context.index)
        elif not self._execute_all_batches:
            raise StopIteration
        return batch, context

    def _release_sent_inputs(self, context: TrainPipelineContext) -> None:
        """Give back what batch ``context``'s all-to-alls sent (P1's output, a row-wise group's
        bucketized KJT), which torchrec keeps until the forward pops the request. On data_dist,
        which allocated them and now waits for the all-to-all (on the device): the next batch's
        allocations there reuse the memory in stream order. Nothing waits on main."""
        if context.index in self._sends_released:
            return
        self._sends_released.add(context.index)
        with self._stream_context(self._data_dist_stream):
            for request in context.input_dist_tensors_requests.values():
                for awaitable in all_to_all_awaitables(request):
                    release_all_to_all_input(awaitable)
                    self.stats.released += 1

    def _sends_done(self, index: int) -> None:
        """Batch ``index``'s all-to-alls have sent its values (data_dist waits for them): the
        permuted copy's slot may take the next batch. A batch no longer in the pipeline was
        read by main's queued work."""
        context = next((c for c in self.contexts if c.index == index), None)
        if context is not None:
            if not context.input_dist_tensors_requests:
                raise RuntimeError(
                    "recpipe: a batch's copy into the permuted copy's slot was needed before "
                    "the batch in the slot was sent (not torchrec's order of input dists); set "
                    "memory_plan = MemoryPlan(free_inputs=False) (torchrec's copies)"
                )
            self._release_sent_inputs(context)
        stream = self._data_dist_stream if context is not None else self._main
        sent = None if stream is None else stream.record_event()
        assert self._permuted is not None
        self._permuted.sent(index, sent)
        if index in self._learned_from and sent is not None:  # (dropped at its first P2)
            self._main.wait_event(sent)  # main's pool: next allocations after the all-to-all

    def _ring_runner(self, batch_index: int) -> Runner:
        if self._split_p1:
            done = self._values_done.setdefault(batch_index, [])
            return self._ring.split_runner(batch_index, self._side, done)
        return write_into(self._ring.allocator(batch_index))

    @contextmanager
    def _input_dists_redirected(self) -> Iterator[None]:
        """Within the block, each pipelined module's ``input_dist`` sees its input KJTs as
        this pipeline's redirecting class (P1: their ``permute``); an instance attribute that
        shadows the class's method, removed on exit, as torchrec's own forward swap is (set in
        the instance ``__dict__``: ``nn.Module.__setattr__`` costs host time every step)."""
        modules, permuted = list(self._pipelined_modules), self._permuted
        for module in modules:
            # before it, the permuted copy learns whether this P1 may be planned (an
            # EmbeddingBagCollection's: nothing else keeps P1's output)
            plannable = None if permuted is None else partial(
                setattr, permuted, "plannable", isinstance(module, ShardedEmbeddingBagCollection))
            vars(module)["input_dist"] = _with_kjt_type(
                module.input_dist, self._kjt_type, self._permuted_inputs, self._sent_whole, plannable)
        try:
            yield
        finally:
            for module in modules:
                del vars(module)["input_dist"]

    def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        late, self._late = self._late, None
        if late is not None:  # (input_dist="after_forward")
            batch, started, copied = late
            assert started is context, "recpipe: a deferred input dist waited out of order"
            with self._copy_waited(batch, copied):
                self._start_input_dist(batch, context)
            self.stats.late_input_dists += 1
        permuted = self._permuted
        before = None  # data_dist waits for the permuted copy: after the splits' host read
        if permuted is not None and not self._bucketized:
            before = partial(permuted.wait, context.index, self._data_dist_stream)
        if self._received_sizes is not None or before is not None:
            sizes = self._received_sizes
            with AllToAllOutputs(sizes, self._device, before) as outputs:
                super().wait_sparse_data_dist(context)
            if sizes is not None:
                self.stats.outputs_sized += outputs.made
        else:
            super().wait_sparse_data_dist(context)
        learned = context.index in self._learned_from
        if (self._redirect_dist_init or learned) and not dist_init_on_main_stream():
            requests = context.input_dist_tensors_requests
            runner = before = None  # recat="ring": the k-th P2 into the slot's k-th buffers
            if self.plan.recat == "ring":
                runner = write_into(self._recat_ring.allocator(context.index))
            if runner is not None or learned:
                before = partial(self._before_recat, context.index, runner)
            kjt_type = self._kjt_type if self._redirect_dist_init else None  # (None: torchrec's P2)
            for name, request in requests.items():
                requests[name] = _DistInitRedirected(request, kjt_type, before)
        elif (self._redirect_dist_init or learned) and not self._p2_moved_said:
            self._p2_moved_said = True
            warnings.warn("recpipe: a later pipeline's clear_data_dist_inputs=True moved P2 to main "
                          "for the process (torchrec's flag): the recat placement stops acting")
        if self._split_p1:  # the splits are read: now data_dist needs the values
            for write in self._values_done.pop(context.index, []):  # none on CPU
                self._data_dist_stream.wait_event(write.event)  # then its inputs may go
            self._release_inputs(context.index, *self._releasable.pop(context.index, ([], None)))
        if permuted is not None:
            self._sends_done(context.index)
            self.stats.permuted_copies = permuted.batches

    def reset(self) -> None:
        """torchrec's ``reset`` (its batches dropped, batch indices from 0 again), and recpipe's
        state kept per batch index."""
        super().reset()
        self._ring.forget_owners()
        self._recat_ring.forget_owners()
        self._late = None
        for kept in (self._copied, self._releasable, self._learned_from):
            kept.clear()
        self._sends_released.clear()
        if self._permuted is not None:
            self._permuted.reset()

    def dequeue_batch(self) -> None:
        # Called on main at the end of progress(): batch contexts[0]'s work is all queued.
        self._ring.release(self.contexts[0].index)
        self._recat_ring.release(self.contexts[0].index)
        if self._copy_ring_on:
            self._copy_ring.release_late(self.contexts[0].index, self._main)
        if self.redirecting is False:  # the first batches' slots, once main is done with them
            self._ring.drop_done()
            self._copy_ring.drop_done()
        self._copied.pop(self.contexts[0].index, None)
        self._sends_released.discard(self.contexts[0].index)
        self._learned_from.pop(self.contexts[0].index, None)  # (if the permuted copy went off)
        if self._permuted is not None:
            self._permuted.forget(self.contexts[0].index)
        super().dequeue_batch()
        if self.redirecting is False:
            self._step_aside_if_done()

    def _step_aside_if_done(self) -> None:
        """Where the plan never acts again (``redirecting`` False: one rank) and no batch holds
        its memory, torchrec's per-step methods are bound on the instance (``reset`` keeps
        them), unless a subclass overrides them or they are set there already (wrappers)."""
        if self.redirecting is False and not self._copied and not (
                self.ring_nbytes or self.copy_ring_nbytes):
            for name in _PER_STEP:
                if name not in vars(self) and getattr(type(self), name) is getattr(
                        TrainPipelineSparseDist, name):
                    vars(self)[name] = getattr(_TorchrecTrainPipelineSparseDist, name).__get__(self)

    @property
    def ring_nbytes(self) -> int:
        """Bytes held by the pipeline-owned permute buffers (P1's ring, the recat ring)."""
        return self._ring.nbytes + self._recat_ring.nbytes

    @property
    def copy_ring_nbytes(self) -> int:
        """Bytes held by the pipeline-owned copy buffers (``inputs="ring"``)."""
        return self._copy_ring.nbytes

    @property
    def copy_ring_reused(self) -> int:
        """Batch tensors copied into memory of an earlier batch's copy (``inputs="ring"``)."""
        return self._copy_ring.reused

    @property
    def copy_ring_replaced(self) -> int:
        """Copy buffers given new memory because a tensor outside the ring still used them."""
        return self._copy_ring.replaced

    @property
    def ring_replaced(self) -> int:
        """Ring buffers (P1's, P2's) given new memory: a result of an earlier batch used them."""
        return self._ring.replaced + self._recat_ring.replaced


# per-step overrides that act as torchrec's once the plan is off (not the in-place copy:
# torchrec's needs a data_copy_stream argument)
_PER_STEP = ("start_sparse_data_dist", "wait_sparse_data_dist", "copy_batch_to_gpu", "dequeue_batch")


def _kept(main: torch.cuda.Stream | None, keep: list[PermuteBuffers]) -> Allocator:
    """P1 buffers from main's pool, appended to ``keep``, which the pipeline drops once main
    waits for the all-to-all that sends them (``_sends_done``). For the batch whose P1 the
    permuted copy learns from: in data_dist's pool its batch-sized output would stay cached for
    good, since later batches' P1 outputs are lengths only; main's activations reuse it."""
    alloc = main_stream_allocator(main)

    def kept(spec: PermuteSpec) -> PermuteBuffers:
        keep.append(alloc(spec))
        return keep[-1]

    return kept


def _on_stream(stream: torch.cuda.Stream, fn: Callable[[], In]) -> In:
    """``fn()`` with ``stream`` current (torchrec's async copy worker: its allocations)."""
    with torch.cuda.stream(stream):
        return fn()


def _nbytes(xs: Iterable[torch.Tensor | KeyedJaggedTensor]) -> int:
    """Bytes of the tensors and of the KJTs' tensors; 0 for none."""
    return sum(kjt_nbytes(x) if isinstance(x, KeyedJaggedTensor) else x.nbytes for x in xs)


def _with_kjt_type(
    input_dist: Callable[..., Awaitable], kjt_type: type[KeyedJaggedTensor],
    permuted: list[KeyedJaggedTensor], sent_whole: list[KeyedJaggedTensor],
    before: Callable[[], None] | None = None,
) -> Callable[..., Awaitable]:
    """``input_dist`` with its plain-KJT arguments of class ``kjt_type`` during the call;
    ``before()`` first. ``permuted``: where ``kjt_type`` notes the KJTs it permuted (P1); an
    argument that this input dist did not permute goes to ``sent_whole``: its all-to-all sends
    the KJT's own tensors (features already in the module's order), so another module's P1
    of that KJT must not free it early, nor the permuted copy reorder it."""

    def redirected(ctx: Any, *args: Any, **kwargs: Any) -> Awaitable:
        kjts = [a for a in (*args, *kwargs.values()) if type(a) is KeyedJaggedTensor]
        if before is not None:
            before()
        seen = len(permuted)
        with as_type(kjts, kjt_type):
            out = input_dist(ctx, *args, **kwargs)
        done = {id(k) for k in permuted[seen:]}
        sent_whole.extend(k for k in kjts if id(k) not in done)
        return out

    return redirected


class _DistInitRedirected(Awaitable[Any]):
    """An input-dist tensors request whose all-to-alls' ``dist_init`` (P2) is ``kjt_type``'s:
    their input KJTs take that class during the wait only (one may be the batch's own KJT,
    when ``KeyedJaggedTensor.split`` returns it whole; None: torchrec's own P2). ``before()`` runs
    first. Streams: torchrec's ``PipelinedForward`` waits it on data_dist, then main on data_dist."""

    def __init__(self, inner: Awaitable[Any], kjt_type: type[KeyedJaggedTensor] | None,
                 before: Callable[[], object] | None = None) -> None:
        super().__init__()
        self._inner, self._kjt_type, self._before = inner, kjt_type, before
        self.awaitables = [inner]  # what it waits on, as torchrec's list awaitables name it

    def _wait_impl(self) -> Any:
        if self._before is not None:
            self._before()
        if self._kjt_type is None:
            return self._inner.wait()
        inputs = [all_to_all_input(a) for a in all_to_all_awaitables(self._inner)]
        with as_type([k for k in inputs if type(k) is KeyedJaggedTensor], self._kjt_type):
            return self._inner.wait()


def _sharding_types(model: torch.nn.Module) -> set[str]:
    """The sharding types of the (DistributedModelParallel) plan; empty without one."""
    plan = getattr(model, "plan", None)
    return set() if plan is None else {
        p.sharding_type for module_plan in plan.plan.values() for p in module_plan.values()}


def _world_size(model: torch.nn.Module) -> int:
    """The sharded model's world size (DistributedModelParallel's), else the default group's."""
    env = getattr(model, "_env", None)
    return env.world_size if env is not None else dist.get_world_size() if dist.is_initialized() else 1

