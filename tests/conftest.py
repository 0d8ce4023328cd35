"""Shared fixtures: the devices to run on (CUDA only where one is present)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import close_pools

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


#: the tests that take CI's 2 cores 30 s or more, longest first: xdist hands tests out in
#: collection order, so these start first and none of them ends the run alone
SLOW_FIRST = (
    "test_bench_pipeline_runs_the_anchors_and_a_dense_allreduce_variant",
    "test_recpipe_on_two_nodes_matches_torchrec_on_one_node",
    "test_python_calls_per_step_do_not_grow_with_the_model",
    "test_losses_bit_identical_on_four_ranks",
    "test_readme_stop_and_resume_commands",
    "test_losses_match_ddp",
    "test_two_ranks_inert_outside_and_narrow_inside",
    "test_two_ranks_resume_bit_identical_with_every_optimizer",
    "test_kill_9_while_training_and_while_saving_then_resume",
    "test_a_failure_on_one_rank_stops_both_after_one_saved_step",
    "test_recpipe_torchrun_stops_on_a_signal_with_one_line_and_resumes_as_printed",
    "test_one_rank_inert_outside_and_narrow_inside",
    "test_sigint_finishes_the_step_saves_and_prints_how_to_resume",
    "test_readme_command_runs",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(SLOW_FIRST)))  # stable


def pytest_sessionfinish() -> None:
    close_pools()  # an xdist worker may end without running atexit handlers
