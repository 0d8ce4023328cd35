"""recpipe's TrainPipelineSparseDist against torchrec's: bit-identical losses, on 2 ranks.

CPU/gloo in CI (table-wise and column-wise; the planner offers no row-wise on CPU); on a GPU
machine with 2 GPUs the same test runs on NCCL, row-wise included (on one GPU shared by the
ranks with ``RECPIPE_SHARED_GPU=1``: gloo).
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from dist_utils import run_ranks
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

from recpipe.pipeline import TrainPipelineSparseDist
from recpipe.testing.launch import SHARED_GPU_ENV, rank_backend_device
from recpipe.pipeline import MemoryPlan
from recpipe.pipeline.plan import Facts, Placements
from recpipe.pipeline.sparse_dist import _sharding_types
from recpipe.testing.synthetic import ModelSpec, batches, build_sharded, shard

STEPS = 16
EMPTY_AT = 7  # one batch without any ids
# consecutive runs of each CUDA-defaults case (scripts/gpu_checks.sh parity-repeat: 200)
_repeats = os.environ.get("RECPIPE_PARITY_REPEATS", "1")
if not _repeats.isdigit() or int(_repeats) < 1:
    raise pytest.UsageError(f"RECPIPE_PARITY_REPEATS={_repeats!r}: give a count >= 1 (runs of each case)")
REPEATS = int(_repeats)
# 2 ranks on GPUs: NCCL, or gloo with RECPIPE_SHARED_GPU=1 on one GPU (recpipe.testing.launch)
GPU2 = rank_backend_device(0, 2)[1].type == "cuda"


class RingEverywherePipeline(TrainPipelineSparseDist):
    _placements = Placements(p1="split_ring")  # world size 1: P1 into the ring on CPU too
    min_batch_bytes = 0  # for every batch, however small


class SmallBatchesPipeline(RingEverywherePipeline):
    min_batch_bytes = 2**40  # every batch is small: torchrec's path


class WholePermutePipeline(RingEverywherePipeline):
    _placements = Placements(p1="ring")  # the whole P1 into the depth-3 ring (several ranks too)


class StableSizesPipeline(TrainPipelineSparseDist):
    # on CPU too, P2 into main-stream buffers
    _placements = Placements(p1="high_water", received="high_water", recat="exact")
    min_batch_bytes = 0  # for every batch, however small


class StableRecatSizesPipeline(StableSizesPipeline):
    # P2's outputs too (the default with row-wise tables)
    _placements = Placements(p1="high_water", received="high_water", recat="high_water")


class LateInputDistPipeline(StableRecatSizesPipeline):
    # the next batch's input dist after the forward, and the copy's slot, whose order it changes
    memory_plan = MemoryPlan(input_dist="after_forward")
    _placements = Placements(p1="high_water", received="high_water", recat="high_water",
                             inputs="permuted")


class LateInputDistOnSmallBatchesPipeline(TrainPipelineSparseDist):
    memory_plan = MemoryPlan(input_dist="after_forward")
    min_batch_bytes = 0  # every other placement at its default


class PermutedCopyPipeline(TrainPipelineSparseDist):
    _placements = Placements(inputs="permuted")  # on CPU and with row-wise tables too
    min_batch_bytes = 0  # for every batch, however small


class ActOnSmallBatchesPipeline(TrainPipelineSparseDist):
    min_batch_bytes = 0  # every placement at its default


class MainRecatPipeline(TrainPipelineSparseDist):
    _placements = Placements(recat="exact")  # P2 into main-stream buffers, on CPU too


class RecatRingPipeline(TrainPipelineSparseDist):
    _placements = Placements(recat="ring")  # P2's outputs in one pipeline slot per call
    min_batch_bytes = 0  # every other placement at its default


def _train(
    rank: int, world: int, device: torch.device, sharding: list[str], steps: int,
    ours: type = TrainPipelineSparseDist, spec: ModelSpec = ModelSpec(), options: dict | None = None,
) -> dict:
    pg = torch.distributed.group.WORLD
    out = {}
    for name, cls in (("torchrec", TorchrecPipeline), ("recpipe", ours)):
        model, optimizer = build_sharded(spec, sharding, device, pg, seed=1)
        pipeline = cls(model, optimizer, device, **(options or {}))
        it = batches(spec, steps, rank, seed=2, empty_at=EMPTY_AT)
        losses = []
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(loss.item())
        with pytest.raises(StopIteration):  # stays exhausted, as torchrec's does
            pipeline.progress(it)
        out[name] = losses
        if name == "recpipe":
            out["redirected"] = asdict(pipeline.stats)
            out["ring_replaced"] = pipeline.ring_replaced
            out["split"] = pipeline.plan.p1 == "split_ring"
            out["device"] = device.type
            out["redirecting"] = pipeline.redirecting
            out["ring_nbytes"] = pipeline.ring_nbytes
            out["copy_ring_nbytes"] = pipeline.copy_ring_nbytes
            out["copy_ring_reused"] = pipeline.copy_ring_reused
            out["copy_ring_replaced"] = pipeline.copy_ring_replaced
            out["copies_held"] = len(pipeline._copied)  # batches' copy records after the run
    return out


SHARDINGS = {
    "table_wise": ["table_wise"],
    "column_wise": ["column_wise"],
    "mixed_tw_cw": ["table_wise", "column_wise"],
}
if GPU2:
    SHARDINGS.update(row_wise=["row_wise"], mixed_tw_rw_cw=["table_wise", "row_wise", "column_wise"])


def test_single_rank_feature_permute_bit_identical() -> None:
    """World size 1: only the feature-order permute (P1) runs; with the ring (the default on
    CUDA; forced here, for CPU) split: lengths on data_dist, values into the depth-2 ring on a
    side stream. The copy ring's slot is released on the side stream."""
    (r,) = run_ranks(1, _train, SHARDINGS["mixed_tw_cw"], STEPS, RingEverywherePipeline)
    assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
    assert r["redirected"].get("input_dist", 0) >= STEPS and not r["redirected"].get("dist_init")
    assert r["split"] and r["ring_replaced"] == 0  # in steady state slots are reused in place
    # on CUDA the inputs' copies reuse the copy ring's memory, never a buffer still held
    # (on CPU nothing is copied)
    assert (r["copy_ring_reused"] >= STEPS - 4) == (r["device"] == "cuda")
    assert r["copy_ring_replaced"] == 0


def test_single_rank_default_redirects_p1_on_cuda_only() -> None:
    """The default at world size 1 (for batches that reach ``min_batch_bytes``): the ring on
    CUDA; on CPU torchrec's own P1 (no streams, so a ring would only hold memory)."""
    (r,) = run_ranks(1, _train, SHARDINGS["mixed_tw_cw"], STEPS, ActOnSmallBatchesPipeline)
    assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
    on_cuda = r["device"] == "cuda"
    assert bool(r["redirected"].get("input_dist")) == on_cuda and r["split"] == on_cuda


def test_single_rank_small_batches_take_torchrecs_path() -> None:
    """Below ``min_batch_bytes``: on CUDA the pipeline's copy of the first batch is below it,
    so no P1 is redirected at all; on CPU (nothing copied) the first batch's P1 inputs are
    measured after its input dist, and its P1 is the last redirected one (its ring slot and
    side-stream write still end as they began, then the slot's memory goes back). The losses
    stay torchrec's."""
    (r,) = run_ranks(1, _train, SHARDINGS["mixed_tw_cw"], STEPS, SmallBatchesPipeline)
    assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
    assert r["redirecting"] is False and r["split"] and r["ring_nbytes"] == 0
    assert r["copy_ring_nbytes"] == 0
    # CPU: the first batch's, one P1 per sparse module
    assert r["redirected"].get("input_dist", 0) == (0 if r["device"] == "cuda" else 3)


def _with_switch(rank: int, world: int, device: torch.device, name: str, value: object) -> str:
    model, optimizer = build_sharded(ModelSpec(), ["table_wise"], device, torch.distributed.group.WORLD)
    cls = type("Switched", (TrainPipelineSparseDist,), {name: value})
    try:
        cls(model, optimizer, device)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("value", [-1, "64MiB", 1.5])
def test_bad_min_batch_bytes_is_named(value: object) -> None:
    (message,) = run_ranks(1, _with_switch, "min_batch_bytes", value)
    assert message == f"min_batch_bytes must be an int >= 0 (bytes; 0: always act), got {value!r}"


@pytest.mark.parametrize(
    "name, plan, expected",
    [
        ("_placements", Placements(inputs="no"), "Placements.inputs must be one of 'fresh', 'ring', "
                                                 "'permuted' or None (auto), got 'no'"),
        ("memory_plan", MemoryPlan(free_inputs=1), "MemoryPlan.free_inputs must be one of True, "
                                                   "False or None (auto), got 1"),
        ("_placements", Placements(p1="split_ring"), "no error"),
        ("_placements", Placements(p1="high_water"), "MemoryPlan: p1='high_water' needs world size "
                                                     "> 1; leave it None"),
        ("_placements", Placements(inputs="permuted"), "MemoryPlan: inputs='permuted' needs world "
                                                       "size > 1 (no all-to-all reads the values); "
                                                       "leave it None"),
        ("memory_plan", MemoryPlan(input_dist="after_forward"), "MemoryPlan: input_dist="
         "'after_forward' needs world size > 1 (no all-to-all at one rank); leave it None"),
        ("_placements", Placements(recat="ring"), "MemoryPlan: recat='ring' needs world size > 1 "
                                                  "(no all-to-all at one rank); leave it None"),
        ("memory_plan", MemoryPlan(free_inputs=False), "no error"),
    ],
)
def test_a_plan_that_does_not_work_is_named(name: str, plan: object, expected: str) -> None:
    (message,) = run_ranks(1, _with_switch, name, plan)
    assert message == expected


def test_a_memory_plan_of_another_type_is_named() -> None:
    (message,) = run_ranks(1, _with_switch, "memory_plan", {"p1": "ring"})
    assert message == "memory_plan must be a recpipe.pipeline.MemoryPlan, got {'p1': 'ring'}"


class _Stream:
    """Notes the events a stream is made to wait for, and the streams a batch is recorded on."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


@pytest.mark.parametrize("fails", [False, True], ids=["starts", "start_raises"])
def test_a_deferred_input_dist_waits_for_its_own_copy_only(fails: bool) -> None:
    """``input_dist="after_forward"``: the deferred start makes data_dist wait for the event of its
    batch's copy and records the batch on data_dist, both before the start (whose early free
    gives the batch's storages back); torchrec's wait for the whole memcpy stream (by then
    also holding batch i+2's copy) sees no stream, and the stream comes back, also when the
    start raises."""
    memcpy, data_dist, event = object(), _Stream(), object()
    pipeline = SimpleNamespace(_memcpy_stream=memcpy, _data_dist_stream=data_dist)
    batch = SimpleNamespace(record_stream=data_dist.waited.append)  # recorded on data_dist
    seen = []
    with pytest.raises(RuntimeError) if fails else nullcontext():
        with TrainPipelineSparseDist._copy_waited(pipeline, batch, event):
            seen.append((pipeline._memcpy_stream, list(data_dist.waited)))
            if fails:
                raise RuntimeError("start")
    assert seen == [(None, [event, data_dist])] and pipeline._memcpy_stream is memcpy
    assert data_dist.waited == [event, data_dist]


def test_a_deferred_input_dist_notes_the_memcpy_event_of_its_batch() -> None:
    """``input_dist="after_forward"``: torchrec's start of batch i+1 (before batch i+2's copy is
    queued) only notes the batch, with an event recorded on the memcpy stream then; the first
    batch (the one in compute) starts at once."""
    event = object()
    memcpy = SimpleNamespace(record_event=lambda: event)
    started = []
    current, following = SimpleNamespace(index=0), SimpleNamespace(index=1)
    pipeline = SimpleNamespace(
        _late_input_dist=True, contexts=[current, following], _memcpy_stream=memcpy, _late=None,
        _start_input_dist=lambda batch, context: started.append(context),
    )
    TrainPipelineSparseDist.start_sparse_data_dist(pipeline, "batch 1", following)
    assert pipeline._late == ("batch 1", following, event) and started == []
    TrainPipelineSparseDist.start_sparse_data_dist(pipeline, "batch 0", current)
    assert started == [current]


def test_single_rank_whole_feature_permute_bit_identical() -> None:
    """``p1="ring"``: the whole P1 into the depth-3 ring."""
    (r,) = run_ranks(1, _train, SHARDINGS["mixed_tw_cw"], STEPS, WholePermutePipeline)
    assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
    assert r["redirected"].get("input_dist", 0) >= STEPS
    assert not r["split"] and r["ring_replaced"] == 0


TORCHREC_OPTIONS = [  # those of the installed torchrec: 1.7 and 1.8 add two each, 1.9 one
    o for o in (
        {"enable_inplace_copy_batch": True, "async_inplace_copy": True},
        {"free_features_storage_early": True, "clear_data_dist_inputs": True},
        {"enable_inplace_copy_batch": True, "free_features_storage_early": True},
    ) if set(o) <= set(inspect.signature(TorchrecPipeline).parameters)
]


@pytest.mark.parametrize("options", TORCHREC_OPTIONS, ids=lambda o: "+".join(o))
def test_torchrec_options_compose(options: dict) -> None:
    """torchrec's own options (its async copy worker: GPUs only, off on CPU) on both sides; no
    batch's copy record outlives the run (the in-place copy stays recpipe's after the step-aside
    to torchrec's methods)."""
    (r,) = run_ranks(1, _train, SHARDINGS["mixed_tw_cw"], 12, TrainPipelineSparseDist,
                     ModelSpec(), options)
    assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == 12
    assert r["copies_held"] == 0, r


def _split_on_two_ranks(rank: int, world: int, device: torch.device) -> str:
    model, optimizer = build_sharded(ModelSpec(), ["table_wise"], device, torch.distributed.group.WORLD)
    try:
        RingEverywherePipeline(model, optimizer, device)
    except ValueError as e:
        return str(e)
    return "no error"


def test_split_feature_permute_refuses_several_ranks() -> None:
    assert all("needs world size 1" in r for r in run_ranks(2, _split_on_two_ranks))


def _recat_where_torchrec_moved_p2(rank: int, world: int, device: torch.device) -> list[str]:
    """The refusal (flag set before the pipeline is built), then the warning (set after)."""
    model, optimizer = build_sharded(ModelSpec(), ["table_wise"], device, torch.distributed.group.WORLD)
    chosen = type("RecatExact", (TrainPipelineSparseDist,), {"_placements": Placements(recat="exact")})
    said = []
    try:
        PipelinedForward._use_main_stream_for_dist_init = True  # what clear_data_dist_inputs sets
        with pytest.raises(ValueError) as refused:
            chosen(model, optimizer, device)
        said.append(str(refused.value))
        PipelinedForward._use_main_stream_for_dist_init = False
        pipeline = chosen(model, optimizer, device)
        PipelinedForward._use_main_stream_for_dist_init = True
        it = batches(ModelSpec(), 6, rank)
        with pytest.warns(UserWarning, match="recat placement stops acting") as warned:
            for _ in range(4):
                pipeline.progress(it)
        said += [str(w.message) for w in warned if "recat placement" in str(w.message)]
    finally:  # (the rank's process serves later tests)
        PipelinedForward._use_main_stream_for_dist_init = False
    return said


def test_a_recat_placement_where_torchrec_moved_p2_to_main_is_refused_or_said() -> None:
    """torchrec's ``clear_data_dist_inputs`` runs every P2 of the process on main (a class
    flag): a recat placement chosen for a pipeline would not act. Set before the pipeline is
    built, the placement is refused; set by a pipeline built later, a warning says so, once."""
    for said in run_ranks(2, _recat_where_torchrec_moved_p2):
        assert "needs P2 on data_dist" in said[0]
        assert len(said) == 2, said  # the refusal, then one warning in 4 steps


def _permuted_copy_on(rank: int, world: int, device: torch.device, sharding: str) -> str:
    model, optimizer = build_sharded(ModelSpec(), [sharding], device, torch.distributed.group.WORLD)
    try:
        return str(PermutedCopyPipeline(model, optimizer, device)._permuted is not None)
    except ValueError as e:
        return str(e)


def test_permuted_copy_refuses_data_parallel_tables() -> None:
    """Data-parallel tables take P1's output to main, past the slot's next write."""
    assert run_ranks(2, _permuted_copy_on, "table_wise") == ["True", "True"]
    expected = ("MemoryPlan: inputs='permuted' does not work with data-parallel tables (main "
                "reads their values); leave it None")
    assert run_ranks(2, _permuted_copy_on, "data_parallel") == [expected] * 2


def _plan_is_bucketized(rank: int, world: int, device: torch.device) -> list[bool]:
    model, _ = build_sharded(ModelSpec(), ["table_wise", "column_wise"], device,
                             torch.distributed.group.WORLD)
    row_wise = SimpleNamespace(
        plan=SimpleNamespace(plan={"ebc": {"t0": SimpleNamespace(sharding_type="row_wise")}})
    )
    return [Facts(1, False, frozenset(_sharding_types(m))).bucketized for m in (model, row_wise)]


def test_split_feature_permute_detects_row_wise_plans() -> None:
    """The split permute is refused for row-wise tables (the CPU planner offers none: the
    check itself is tested on a real table-/column-wise plan and a row-wise one)."""
    assert run_ranks(1, _plan_is_bucketized) == [[False, True]]


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_losses_bit_identical_to_torchrec(sharding: str) -> None:
    results = run_ranks(2, _train, SHARDINGS[sharding], STEPS)
    for rank, r in enumerate(results):
        assert len(r["torchrec"]) == STEPS, r
        assert r["recpipe"] == r["torchrec"], f"rank {rank}: losses differ"
        # The first batch's copy is below min_batch_bytes: on CUDA that turns the high-water
        # sizes and P2's placement off before its input dist (on CPU, with no streams, they are
        # off anyway): no permute output and no all-to-all output is sized, P2 is torchrec's.
        assert r["redirected"].get("dist_init", 0) == 0, r["redirected"]
        assert r["redirected"].get("input_dist", 0) == 0, r["redirected"]
        assert r["redirected"].get("outputs_sized", 0) == 0, r["redirected"]
        # what each batch's all-to-alls sent is given back a step early (all but the last batch)
        assert r["redirected"].get("released", 0) >= STEPS - 1, r["redirected"]


class HighWaterPipeline(TrainPipelineSparseDist):
    _placements = Placements(p1="high_water", received="high_water")  # CUDA's at world size > 1


class RecatSetPipeline(TrainPipelineSparseDist):
    _placements = Placements(p1="high_water", received="high_water", recat="exact")


def _p2_below_min_batch_bytes(rank: int, world: int, device: torch.device) -> dict:
    """Small batches, CUDA's defaults at world size 2 (P2's placement resolved as on CUDA):
    per pipeline, bit-identical losses and the P2 calls redirected."""
    from recpipe.pipeline import plan

    default_recat = plan._default_recat
    plan._default_recat = lambda facts, received: "exact" if facts.world > 1 else default_recat(facts, received)
    try:
        runs = {name: _train(rank, world, device, ["table_wise"], STEPS, cls)
                for name, cls in (("default", HighWaterPipeline), ("set", RecatSetPipeline))}
    finally:  # (the rank's process serves later tests)
        plan._default_recat = default_recat
    return {name: (r["recpipe"] == r["torchrec"], r["redirected"].get("dist_init", 0)) for name, r in runs.items()}


def test_small_batches_take_torchrecs_p2_unless_recat_is_set() -> None:
    """Below ``min_batch_bytes`` P2's default placement turns off with the high-water sizes
    (its interception costs host time for little memory); a ``recat`` the user set stays."""
    for r in run_ranks(2, _p2_below_min_batch_bytes):
        assert r["default"] == (True, 0), r
        assert r["set"][0] and r["set"][1] >= STEPS, r


def test_feature_permute_ring_on_two_ranks_bit_identical() -> None:
    """P1 into the ring on 2 ranks (``p1="ring"``), features regrouped."""
    results = run_ranks(2, _train, SHARDINGS["mixed_tw_cw"], STEPS, WholePermutePipeline)
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
        assert r["redirected"].get("input_dist", 0) >= STEPS and r["ring_replaced"] == 0


@pytest.mark.parametrize("sharding", ["mixed_tw_cw", "mixed_tw_rw_cw"] if GPU2 else ["mixed_tw_cw"])
def test_permuted_copy_bit_identical_on_two_ranks(sharding: str) -> None:
    """``inputs="permuted"``: from the second batch on, one KJT per batch (an
    EmbeddingBagCollection's) is copied in P1's order into the slot, written once the previous
    batch's all-to-all has sent it; P1 permutes its lengths alone. A copy written too early
    would change what the all-to-all sends, and the losses."""
    results = run_ranks(2, _train, SHARDINGS[sharding], STEPS, PermutedCopyPipeline)
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
        # every batch but the first (learned from) and the one without ids
        assert r["redirected"]["permuted_copies"] >= STEPS - 2, r["redirected"]


def test_recat_ring_bit_identical_on_two_ranks() -> None:
    """``recat="ring"``: every P2 output of a batch in its call's slot of a one-slot ring, written
    again by the next batch's forward once main's event at the end of the step has passed; no
    result of an earlier batch is overwritten (``ring_replaced``)."""
    results = run_ranks(2, _train, SHARDINGS["mixed_tw_cw"], STEPS, RecatRingPipeline)
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
        assert r["redirected"].get("dist_init", 0) >= STEPS, r["redirected"]
        assert r["ring_nbytes"] > 0 and r["ring_replaced"] == 0, r


@pytest.mark.skipif(not GPU2, reason="the defaults below act on CUDA")
@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("sharding, ours", [
    ("mixed_tw_cw", ActOnSmallBatchesPipeline),
    ("mixed_tw_rw_cw", ActOnSmallBatchesPipeline),
    ("mixed_tw_rw_cw", LateInputDistOnSmallBatchesPipeline),
    ("mixed_tw_rw_cw", RecatRingPipeline),
], ids=["tw_cw", "tw_rw_cw", "tw_rw_cw-after_forward", "tw_rw_cw-recat_ring"])
def test_cuda_defaults_on_every_batch_bit_identical_on_two_ranks(sharding: str, ours: type, repeat: int) -> None:
    """Every default placement acting from the first batch (``min_batch_bytes = 0``): on CUDA at
    world size 2 that is the permuted copy (row-wise plans too), high-water sizes for P1 and
    the all-to-all outputs, and with row-wise tables for P2's outputs; with row-wise tables
    also with ``input_dist="after_forward"`` (the bucketize after the forward, waiting for the
    permuted copy)."""
    results = run_ranks(2, _train, SHARDINGS[sharding], STEPS, ours)
    late = STEPS - 1 if ours is LateInputDistOnSmallBatchesPipeline else 0
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
        assert r["redirected"]["permuted_copies"] >= STEPS - 2, r["redirected"]
        assert r["redirected"].get("outputs_sized", 0) >= 13 * (STEPS - 1), r["redirected"]
        assert r["redirected"].get("late_input_dists", 0) == late, r["redirected"]


@pytest.mark.parametrize(
    "ours", [StableSizesPipeline, StableRecatSizesPipeline, LateInputDistPipeline],
    ids=["high_water", "recat_high_water", "after_forward"],
)
def test_high_water_sizes_bit_identical_on_two_ranks(ours: type) -> None:
    """High-water sizes (the CUDA default) on CPU: P1 goes through recpipe's op into
    high-water-sized buffers, and so do the all-to-all outputs (lengths and values of each of
    the 3 modules' 2 groups, the weighted module's weights too), and with
    ``recat="high_water"`` P2's outputs (their values a view of the front of a larger buffer),
    and with ``input_dist="after_forward"`` every next batch's input dist after the forward; the
    losses stay torchrec's."""
    results = run_ranks(2, _train, SHARDINGS["mixed_tw_cw"], STEPS, ours)
    late = STEPS - 1 if ours is LateInputDistPipeline else 0
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == STEPS
        assert r["redirected"].get("input_dist", 0) >= STEPS, r["redirected"]
        assert r["redirected"].get("outputs_sized", 0) >= 13 * (STEPS - 1), r["redirected"]
        assert r["redirected"].get("late_input_dists", 0) == late, r["redirected"]
        if late:  # (and the permuted copy's slot, whose order it changes)
            assert r["redirected"]["permuted_copies"] >= STEPS - 2, r["redirected"]


def test_losses_bit_identical_on_four_ranks() -> None:
    """4 ranks (issue 7's correctness check; gloo on CPU): mixed table-/column-wise, P2 into
    main-stream buffers (CUDA's default), half the steps (4 ranks on CI's 2 cores)."""
    steps = STEPS // 2
    results = run_ranks(4, _train, SHARDINGS["mixed_tw_cw"], steps, MainRecatPipeline)
    for r in results:
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) == steps
        assert r["redirected"].get("dist_init", 0) >= steps, r["redirected"]


def test_rank_backend_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL with a GPU per rank; gloo on the CPU otherwise, or on a shared GPU when asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(SHARED_GPU_ENV, raising=False)
    assert rank_backend_device(0, 1) == ("nccl", torch.device("cuda", 0))
    assert rank_backend_device(1, 2) == ("gloo", torch.device("cpu"))
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    assert rank_backend_device(1, 2) == ("gloo", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert rank_backend_device(1, 2) == ("gloo", torch.device("cpu"))


def _train_with_reset(rank: int, world: int, device: torch.device) -> dict:
    """6 steps, ``reset()`` with batches in flight, then a new iterator to its end."""
    pg = torch.distributed.group.WORLD
    out = {}
    for name, cls in (("torchrec", TorchrecPipeline), ("recpipe", PermutedCopyPipeline)):
        model, optimizer = build_sharded(ModelSpec(), SHARDINGS["mixed_tw_cw"], device, pg, seed=1)
        pipeline = cls(model, optimizer, device)
        losses = []
        for seed, steps in ((2, 6), (3, None)):
            it = batches(ModelSpec(), STEPS, rank, seed=seed)
            for _ in range(steps or STEPS):
                try:
                    losses.append(pipeline.progress(it)[0].item())
                except StopIteration:
                    break
            pipeline.reset()
        out[name] = losses
        if name == "recpipe":
            out["permuted_copies"] = pipeline.stats.permuted_copies
    return out


class _SharedKJTModel(nn.Module):
    """Two EmbeddingBagCollections over the one ``ebc`` KJT, of one table each that all its
    features share: ``ordered`` takes them in the KJT's order (its input dist sends the KJT's
    own tensors), ``reversed`` in reverse (its input dist permutes the KJT)."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        super().__init__()
        features = spec.features("ebc")
        self.sparse = nn.ModuleDict({
            name: EmbeddingBagCollection(
                [EmbeddingBagConfig(name=name, embedding_dim=spec.dim, num_embeddings=spec.rows,
                                    feature_names=order)],
                device=device,
            )
            for name, order in (("ordered", features), ("reversed", features[::-1]))
        })
        self.head = nn.Linear(2 * spec.dim * len(features) + spec.dense_in, 1, device=device)

    def tables(self) -> list[list[str]]:
        return [[c.name for c in bags.embedding_bag_configs()] for bags in self.sparse.values()]

    def forward(self, batch: object) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        kjt = batch.sparse["ebc"]
        pooled = [bags(kjt).values() for bags in self.sparse.values()]
        logits = self.head(torch.cat([*pooled, batch.dense], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _train_shared_kjt(rank: int, world: int, device: torch.device) -> dict:
    spec = ModelSpec(weighted=False, sequence=False)
    out = {}
    for name, cls in (("torchrec", TorchrecPipeline), ("recpipe", PermutedCopyPipeline)):
        torch.manual_seed(1)
        model = _SharedKJTModel(spec, device)
        dmp, optimizer = shard(model, model.sparse, model.tables(), ["table_wise"], device,
                               torch.distributed.group.WORLD)
        pipeline = cls(dmp, optimizer, device)
        it = batches(spec, STEPS, rank, seed=2)
        out[name] = [pipeline.progress(it)[0].item() for _ in range(STEPS)]
        if name == "recpipe":
            out["redirected"] = asdict(pipeline.stats)
    return out


def test_a_kjt_that_one_module_permutes_and_another_sends_as_it_is() -> None:
    """The permuted copy plans no KJT that another module's all-to-all sends as it is (that
    module would get the values in the other's order): losses stay torchrec's."""
    for r in run_ranks(2, _train_shared_kjt):
        assert r["recpipe"] == r["torchrec"], r
        assert r["redirected"]["input_dist"] == STEPS  # P1: the reversed module's alone
        assert r["redirected"]["permuted_copies"] == 0


@pytest.mark.skipif(not hasattr(TorchrecPipeline, "reset"), reason="torchrec without reset()")
def test_permuted_copy_after_reset_bit_identical() -> None:
    """torchrec's ``reset()`` drops the batches in flight and numbers batches from 0 again: the
    permuted copy's per-batch state goes with them (a stale one would skip a send's wait)."""
    for r in run_ranks(2, _train_with_reset):
        assert r["recpipe"] == r["torchrec"] and len(r["torchrec"]) > STEPS, r
        assert r["permuted_copies"] >= STEPS, r
