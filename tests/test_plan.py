"""The memory plan's defaults and refusals (recpipe.pipeline.plan.resolve): a pure function of
the world size, the device, the sharding types and torchrec's own options."""

from __future__ import annotations

from dataclasses import fields

import pytest

from recpipe.pipeline.plan import Facts, MemoryPlan, Placements, resolve

TW_CW = frozenset({"table_wise", "column_wise"})
TW_RW = frozenset({"table_wise", "row_wise"})


@pytest.mark.parametrize("facts, expected", [
    # one GPU: P1 into the split ring (the whole ring with row-wise tables), the copy ring
    (Facts(1, True, TW_CW), Placements("ring", True, "split_ring", "exact", "torchrec", "before_forward")),
    (Facts(1, True, TW_RW), Placements("ring", True, "ring", "exact", "torchrec", "before_forward")),
    # several GPUs: the permuted copy, high-water sizes; P2 in main's pool, sized with row-wise
    (Facts(2, True, TW_CW), Placements("permuted", True, "high_water", "high_water", "exact",
                                       "before_forward")),
    (Facts(2, True, TW_RW), Placements("permuted", True, "high_water", "high_water", "high_water",
                                       "before_forward")),
    # data-parallel tables (main reads P1's values): the copy ring instead of the permuted copy
    (Facts(2, True, TW_CW | {"data_parallel"}), Placements("ring", True, "high_water", "high_water",
                                                          "exact", "before_forward")),
    # torchrec's own copy or early free: its copy; its clear_data_dist_inputs: no P1 ring
    (Facts(2, True, TW_CW, torchrec_copies_or_frees=True),
     Placements("fresh", True, "high_water", "high_water", "exact", "before_forward")),
    (Facts(1, True, TW_CW, torchrec_clears=True),
     Placements("ring", True, "fresh", "exact", "torchrec", "before_forward")),
    # P2 on main for the process (torchrec's flag, another pipeline's clear_data_dist_inputs)
    (Facts(2, True, TW_RW, p2_on_main=True),
     Placements("ring", True, "high_water", "high_water", "torchrec", "before_forward")),
    # CPU: no streams, torchrec's placements but the early give-back of what was sent
    (Facts(1, False, TW_CW), Placements("fresh", False, "fresh", "exact", "torchrec", "before_forward")),
    (Facts(2, False, TW_CW), Placements("fresh", False, "fresh", "exact", "torchrec", "before_forward")),
])
def test_defaults(facts: Facts, expected: Placements) -> None:
    assert resolve(MemoryPlan(), facts) == expected


def test_after_forward_copies_fresh_where_not_permuted() -> None:
    """The one-slot copy ring saves nothing when the next batch's copy comes before the
    release: with the input dist after the forward the copies are torchrec's."""
    plan = resolve(MemoryPlan(input_dist="after_forward"), Facts(2, True, TW_CW | {"data_parallel"}))
    assert plan.inputs == "fresh"
    assert resolve(MemoryPlan(input_dist="after_forward"), Facts(2, True, TW_RW)).inputs == "permuted"


def test_a_chosen_field_stays_and_the_rest_follow_the_model() -> None:
    plan = resolve(MemoryPlan(free_inputs=False), Facts(2, True, TW_RW), Placements(recat="ring"))
    assert plan == Placements("fresh", False, "high_water", "high_water", "ring", "before_forward")


def test_the_users_fields_win_over_the_private_placements() -> None:
    plan = resolve(MemoryPlan(free_inputs=False, input_dist="after_forward"), Facts(2, True, TW_RW),
                   Placements(free_inputs=True, input_dist="before_forward"))
    assert (plan.free_inputs, plan.input_dist) == (False, "after_forward")


def test_the_user_chooses_three_switches() -> None:
    """The public surface (README's options): ``MemoryPlan``'s two fields and
    ``min_batch_bytes``; every other placement is the pipeline's choice."""
    assert [f.name for f in fields(MemoryPlan)] == ["free_inputs", "input_dist"]


def test_p2_on_main_matters_only_where_there_is_a_p2() -> None:
    """At one rank there is no all-to-all, so no P2 to move: ``recat="exact"`` stays allowed."""
    for facts in (Facts(1, True, TW_CW, p2_on_main=True), Facts(1, True, TW_CW, torchrec_clears=True)):
        assert resolve(MemoryPlan(), facts, Placements(recat="exact")).recat == "exact"


@pytest.mark.parametrize("plan, facts, problem", [
    (Placements(p1="split_ring"), Facts(2, True, TW_CW), "p1='split_ring' needs world size 1"),
    (Placements(p1="split_ring"), Facts(1, True, TW_RW), "does not work with row-wise tables"),
    (Placements(p1="ring"), Facts(1, True, TW_CW, torchrec_clears=True), "clear_data_dist_inputs"),
    (Placements(inputs="ring"), Facts(1, False, TW_CW), "inputs='ring' needs free_inputs on CUDA"),
    (Placements(inputs="permuted"), Facts(2, True, frozenset()), "needs a sharding plan"),
    (Placements(inputs="permuted"), Facts(2, True, TW_CW, postproc=True), "pipeline_postproc"),
    (Placements(recat="ring"), Facts(1, True, TW_CW), "recat='ring' needs world size > 1"),
    (Placements(received="high_water"), Facts(1, True, TW_CW), "received='high_water' needs world"),
    (Placements(recat="ring"), Facts(2, True, TW_CW, torchrec_clears=True), "P2 on main"),
    (Placements(recat="high_water"), Facts(2, True, TW_RW, p2_on_main=True), "needs P2 on data_dist"),
    (Placements(inputs="permuted"), Facts(2, True, TW_CW, p2_on_main=True), "or P2 on main"),
    (Placements(inputs="permuted", free_inputs=False), Facts(2, True, TW_CW), "needs free_inputs"),
    (Placements(inputs="ring", input_dist="after_forward"), Facts(2, True, TW_CW | {"data_parallel"}),
     "saves nothing with input_dist='after_forward'"),
    (Placements(p1=True), Facts(1, True, TW_CW), "Placements.p1 must be one of"),
    (MemoryPlan(free_inputs=0), Facts(1, True, TW_CW), "MemoryPlan.free_inputs must be one of"),
    (MemoryPlan(input_dist="after_forward"), Facts(1, True, TW_CW),
     "MemoryPlan: input_dist='after_forward' needs world size > 1"),
])
def test_a_placement_that_does_not_work_is_named(plan: MemoryPlan | Placements, facts: Facts,
                                                 problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")) as e:
        resolve(plan, facts) if isinstance(plan, MemoryPlan) else resolve(MemoryPlan(), facts, plan)
    assert "\n" not in str(e.value)
