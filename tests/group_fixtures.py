"""Fixtures for the all-reduce tests: a real one-rank group in the test's own process (no spawned
ranks: the tests stay fast), and a group that looks like 2 GPUs with symmetric memory on the
shipped 2 x H200 table (for the host-side choices; nothing may run its kernels)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from dist_utils import one_rank

from recpipe.ops import all_reduce
from recpipe.ops.all_reduce_table import LatencyTable, Machine, read_table, shipped_path

H200: LatencyTable = read_table(shipped_path(Machine("NVIDIA H200", 2, "any", "any")))


@pytest.fixture(name="local_group")
def local_group_fixture() -> Iterator[dist.ProcessGroup]:
    """The default group, of this process alone (gloo); destroyed after the test."""
    with one_rank():
        yield dist.group.WORLD


@pytest.fixture(name="symmetric_h200")
def symmetric_h200_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group: 2 ranks, with symmetric memory for its dtypes, and the shipped H200 table."""
    monkeypatch.setattr(all_reduce, "_symmetric_group",
                        lambda dtype, device_type, name: dtype in all_reduce.SYMM_DTYPES)
    monkeypatch.setattr(all_reduce, "_group_size", lambda name: 2)
    monkeypatch.setattr(all_reduce, "_table", lambda world: H200)
