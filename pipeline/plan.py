"""The memory plan: where each batch-sized tensor of the input path lives, and when it is reused.

torchrec's pipeline has three batches in flight: batch i+2 is copied (memcpy stream), batch i+1
is input-distributed (data_dist stream), batch i is computed (main stream). Each batch-sized
tensor of that path is written on one stream, read on others, and its memory may be written
again only after its last reader; torchrec leaves that to ``record_stream``, which keeps every
block until the reader's queued work is done, so each pool holds one batch more than needed.
:class:`Placements` names one placement per tensor; :func:`resolve` fills in the defaults for a
model and the user's :class:`MemoryPlan`, and the pipeline (:mod:`recpipe.pipeline.sparse_dist`)
follows it:

============  ===========  ==============  ===========  ===================================
tensor        written on   read on         by batch     placement: memory reused when
============  ===========  ==============  ===========  ===================================
``inputs``    memcpy       data_dist (P1)  i+2 -> i+1   ``"ring"``: one pipeline slot, after
(copied P1                                              an event on the stream of the last
inputs)                                                 P1 read. ``"permuted"`` (world > 1):
                                                        the largest KJT's values copied in
                                                        P1's order into one slot that the
                                                        all-to-all sends, after its event.
                                                        ``free_inputs``: others freed once
                                                        the input dists are queued.
``p1``        data_dist    data_dist       i+1         ``"ring"``: 3 slots (batch in step,
(feature      (side: the   (all-to-all);   (world 1:   in compute, next), after main's event
permute)      split        main at world   i)          at the end of the slot's step.
              values)      size 1                      ``"split_ring"``: values on a side
                                                        stream into 2 slots, lengths fresh.
                                                        ``"high_water"``: data_dist's pool,
                                                        sized to the site's high-water mark.
sent          data_dist    all-to-all      i+1         world > 1: dropped on data_dist once
(P1 output,                                             its all-to-all is waited, not a step
bucketized)                                             later at the forward (always).
``received``  data_dist    data_dist (P2)  i+1 -> i    ``"high_water"``: sized to the site's
(all-to-all                                             high-water mark, so that the block
outputs)                                                the last batch freed fits.
``recat``     data_dist    main            i           ``"exact"``: main's pool, after an
(P2 output)                (forward,                   event on main (no ``record_stream``);
                           backward)                   ``"torchrec"``: data_dist's (CPU, or
                                                        torchrec's P2 on main: no other).
                                                        ``"high_water"``: sized per module,
                                                        for varying row-wise ids. ``"ring"``:
                                                        one pipeline slot (a buffer per P2
                                                        call), after main's event at the end
                                                        of the slot's step (out of main's
                                                        pool, where it splits backward's
                                                        large blocks).
============  ===========  ==============  ===========  ===================================

``input_dist="after_forward"`` starts batch i+1's input dist after batch i's forward is queued,
so that its data_dist allocations reuse what that forward's P2 dropped: less memory, at the cost
of a host read of the splits behind that forward. The copy ring then saves nothing (the next
batch's copy comes before the release), so the copies are ``"fresh"`` where not ``"permuted"``.

recpipe's placements are ordered by events, not by ``record_stream``: a slot is written again
only after its last reader's event; main-stream memory is freed by main, in stream order.
``"fresh"`` and ``"torchrec"`` are torchrec's own (``record_stream``), as are the split
permute's small lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal, get_args

Inputs = Literal["fresh", "ring", "permuted"]
FeaturePermute = Literal["fresh", "ring", "split_ring", "high_water"]
Sizes = Literal["exact", "high_water"]
Recat = Literal["torchrec", "exact", "high_water", "ring"]
InputDist = Literal["before_forward", "after_forward"]

_CHOICES: dict[str, tuple[object, ...]] = dict(
    inputs=get_args(Inputs), free_inputs=(True, False), p1=get_args(FeaturePermute),
    received=get_args(Sizes), recat=get_args(Recat), input_dist=get_args(InputDist))
# sharding types whose input dist sends P1's output as it is or bucketizes it: P1's order holds
_COPIED_IN_ORDER = frozenset({"table_wise", "column_wise", "table_column_wise", "row_wise"})


@dataclass(frozen=True)
class MemoryPlan:
    """The user's choices, each None for the model's default (:func:`resolve`; README): keep the
    inputs (``free_inputs=False``) for a forward that reads them outside the sharded modules;
    ``input_dist="after_forward"`` trades step time for memory on row-wise plans."""

    free_inputs: bool | None = None
    input_dist: InputDist | None = None


@dataclass(frozen=True)
class Placements:
    """One placement per batch-sized tensor of the input path (module docstring), chosen for the
    model (``pipeline.plan``). Not a product option: the pipeline's private ``_placements`` may
    set one for tests and ablations; a :class:`MemoryPlan` field set by the user wins."""

    inputs: Inputs | None = None
    free_inputs: bool | None = None
    p1: FeaturePermute | None = None
    received: Sizes | None = None
    recat: Recat | None = None
    input_dist: InputDist | None = None


@dataclass(frozen=True)
class Facts:
    """What the plan depends on: world size, device, the sharding plan's types, and torchrec's
    own options (its in-place copy or early free; its ``clear_data_dist_inputs``; a pipelined
    postproc; ``p2_on_main``: its process-wide flag, set by any ``clear_data_dist_inputs``)."""

    world: int
    cuda: bool
    types: frozenset[str] = frozenset()
    torchrec_copies_or_frees: bool = False
    torchrec_clears: bool = False
    postproc: bool = False
    p2_on_main: bool = False

    @property
    def bucketized(self) -> bool:
        """Whether a table is row-wise in some form: its input dist reads P1's values on
        data_dist (bucketize) before the splits are known."""
        return any(t == "grid_shard" or "row_wise" in t for t in self.types)


def resolve(user: MemoryPlan, facts: Facts, chosen: Placements = Placements()) -> Placements:
    """The placements for ``facts``: the user's fields, then ``chosen``'s, then the defaults; a
    value that does not work there is a one-line ``ValueError`` that names the fix."""
    for given in (user, chosen):
        for f in fields(given):
            value = getattr(given, f.name)
            if value is not None and (value not in _CHOICES[f.name] or type(value) is int):
                choices = ", ".join(repr(c) for c in _CHOICES[f.name])
                raise ValueError(f"{type(given).__name__}.{f.name} must be one of {choices} or "
                                 f"None (auto), got {value!r}")
    plan = replace(chosen, **{f.name: getattr(user, f.name) for f in fields(user)
                              if getattr(user, f.name) is not None})
    world, cuda = facts.world, facts.cuda
    # only the pipeline's own copies are freed; on CPU ``to()`` copies nothing
    free = cuda and plan.free_inputs is not False
    p1 = plan.p1 or _default_p1(facts)
    problem = _p1_problem(p1, facts)
    received = plan.received or ("high_water" if cuda and world > 1 else "exact")
    input_dist = plan.input_dist or "before_forward"
    inputs = plan.inputs or _default_inputs(facts, free, input_dist)
    problem = problem or _inputs_problem(inputs, facts, free, plan.free_inputs, input_dist)
    problem = problem or _several_ranks_problem(plan, facts)
    if problem:
        raise ValueError(f"MemoryPlan: {problem}; leave it None")
    return Placements(inputs, free, p1, received, plan.recat or _default_recat(facts, received),
                      input_dist)


def _default_recat(facts: Facts, received: Sizes) -> Recat:
    if not facts.cuda or facts.world == 1 or facts.p2_on_main:  # no streams, no recat, or on main
        return "torchrec"
    return "high_water" if facts.bucketized and received == "high_water" else "exact"


def _default_p1(facts: Facts) -> FeaturePermute:
    if not facts.cuda:  # the CPU allocator frees torchrec's output at once
        return "fresh"
    if facts.world > 1:  # the all-to-all reads it on data_dist and drops it
        return "high_water"
    if facts.torchrec_clears:
        return "fresh"
    return "ring" if facts.bucketized else "split_ring"


def _p1_problem(p1: FeaturePermute, facts: Facts) -> str | None:
    if p1 in ("ring", "split_ring") and facts.torchrec_clears:
        return f"p1={p1!r} does not work with torchrec's clear_data_dist_inputs"
    if p1 == "split_ring" and facts.world > 1:
        return "p1='split_ring' needs world size 1 (the values all-to-all is queued first)"
    if p1 == "split_ring" and facts.bucketized:
        return "p1='split_ring' does not work with row-wise tables (bucketized on data_dist)"
    if p1 == "high_water" and facts.world == 1:
        return "p1='high_water' needs world size > 1"
    return None


def _several_ranks_problem(plan: Placements, facts: Facts) -> str | None:
    """A placement of the all-to-all's tensors chosen where they are not intercepted."""
    if facts.world == 1:
        for name in ("received", "recat", "input_dist"):
            value = getattr(plan, name)
            if value not in (None, "exact", "torchrec", "before_forward"):
                return f"{name}={value!r} needs world size > 1 (no all-to-all at one rank)"
    if facts.world > 1 and plan.recat not in (None, "torchrec") and (
            facts.torchrec_clears or facts.p2_on_main):
        return (f"recat={plan.recat!r} needs P2 on data_dist: torchrec runs P2 on main in the "
                "process once any pipeline has clear_data_dist_inputs=True")
    return None


def _default_inputs(facts: Facts, free: bool, input_dist: InputDist) -> Inputs:
    if not free or facts.torchrec_copies_or_frees:
        return "fresh"
    if (facts.world > 1 and not (facts.torchrec_clears or facts.p2_on_main) and not facts.postproc
            and facts.types and facts.types <= _COPIED_IN_ORDER):
        return "permuted"
    return "fresh" if input_dist == "after_forward" else "ring"


def _inputs_problem(inputs: Inputs, facts: Facts, free: bool, chosen_free: bool | None,
                    input_dist: InputDist) -> str | None:
    if inputs == "ring" and (not free or facts.torchrec_copies_or_frees):
        return "inputs='ring' needs free_inputs on CUDA and the pipeline's own copy"
    if inputs == "ring" and input_dist == "after_forward":
        return "inputs='ring' saves nothing with input_dist='after_forward' (copy before release)"
    if inputs != "permuted":
        return None
    if chosen_free is False:  # the model reads the inputs elsewhere: not in P1's order
        return "inputs='permuted' needs free_inputs (only the input dists may read the values)"
    return (
        "inputs='permuted' needs world size > 1 (no all-to-all reads the values)"
        if facts.world == 1
        else "inputs='permuted' needs a sharding plan (DistributedModelParallel's)"
        if not facts.types
        else "inputs='permuted' does not work with data-parallel tables (main reads their values)"
        if "data_parallel" in facts.types
        else "inputs='permuted' does not work with pipeline_postproc (it may read the values)"
        if facts.postproc
        else "inputs='permuted' does not work with torchrec's own copy, input frees or P2 on main"
        if facts.torchrec_copies_or_frees or facts.torchrec_clears or facts.p2_on_main
        else None
    )
