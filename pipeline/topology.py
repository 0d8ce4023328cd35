"""Where the ranks sit, and what depends on it: the torchrec planner's ``Topology`` and whether a
process group stays inside one node (symmetric memory is node-local).

torchrun numbers ranks node by node: with ``--nproc-per-node=G`` on every node, rank ``r`` is
local rank ``r % G`` of node ``r // G`` and every process gets ``LOCAL_WORLD_SIZE=G``. That
layout, nodes of equal size, is the one supported; :func:`node_layout` refuses others with one
line. Without ``LOCAL_WORLD_SIZE`` (one process, or ranks spawned on one host by the tests and
benches) all ranks are on one node.

    layout = node_layout(dist.get_world_size())    # 2 nodes x 2 rank(s), under torchrun
    topology = planner_topology(layout, device)    # for EmbeddingShardingPlanner
    group_is_node_local(layout, dist.group.WORLD)  # False: symmetric memory stays off
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: per GPU and direction: H200 NVLink (900 GB/s both ways), a 400 Gb/s NIC
INTRA_NODE_GB_S = 450.0
INTER_NODE_GB_S = 50.0


class LayoutError(ValueError):
    """The ranks do not form nodes of equal size; the message says how to launch."""


@dataclass(frozen=True)
class NodeLayout:
    """``world_size`` ranks in nodes of ``local_world_size``, numbered node by node."""

    world_size: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise LayoutError(
                f"{self.world_size} ranks do not split into nodes of LOCAL_WORLD_SIZE="
                f"{self.local_world_size}: launch the same --nproc-per-node on every node")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_local(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` (global) are all on one node."""
        return len({self.node_of(r) for r in ranks}) <= 1

    def __str__(self) -> str:
        nodes = self.num_nodes
        return f"{nodes} node{'s' * (nodes > 1)} x {self.local_world_size} rank(s)"


def node_layout(world_size: int, env: Mapping[str, str] = os.environ) -> NodeLayout:
    """This job's layout from torchrun's environment (``LOCAL_WORLD_SIZE``; ``RANK``,
    ``LOCAL_RANK`` and ``GROUP_RANK`` checked against it where set). Raises
    :class:`LayoutError` for nodes of unequal size."""
    layout = NodeLayout(world_size, int(env.get("LOCAL_WORLD_SIZE", world_size)))
    if all(k in env for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")):
        rank, local, node = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
        if rank != node * layout.local_world_size + local:
            raise LayoutError(
                f"rank {rank} is local rank {local} of node {node}, not of nodes of "
                f"{layout.local_world_size} ranks: launch the same --nproc-per-node on every node")
    return layout


def group_is_node_local(layout: NodeLayout, group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` is on one node: where symmetric memory may be used."""
    return layout.node_local(dist.get_process_group_ranks(group))


def planner_topology(
    layout: NodeLayout,
    device: torch.device,
    intra_node_gb_s: float = INTRA_NODE_GB_S,
    inter_node_gb_s: float = INTER_NODE_GB_S,
) -> "Topology":  # noqa: F821 (torchrec, imported here)
    """torchrec's planner ``Topology`` for ``layout``: hierarchical plans (table-row-wise, grid)
    group each node's ranks, and the cost model prices traffic inside a node at
    ``intra_node_gb_s`` and across nodes at ``inter_node_gb_s`` (GB/s per GPU and direction).

    On CUDA the plan puts rank ``r``'s shards on ``cuda:(r % local_world_size)``; ranks sharing
    a GPU (``recpipe.testing.launch``) make the local size the GPU count."""
    from torchrec.distributed.planner import Topology

    local = layout.local_world_size
    if device.type == "cuda":
        local = min(local, torch.cuda.device_count())
    per_ms = 1e9 / 1e3  # GB/s in torchrec's unit, bytes/ms
    return Topology(
        world_size=layout.world_size, compute_device=device.type, local_world_size=local,
        intra_host_bw=intra_node_gb_s * per_ms, inter_host_bw=inter_node_gb_s * per_ms,
    )
