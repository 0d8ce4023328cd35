"""The node layout from torchrun's environment, in one place (recpipe.pipeline.topology): faked
environments of 2 nodes x 2, 1 x 4 and 4 x 1 ranks; the planner's Topology; the refusals."""

from __future__ import annotations

import pytest
import torch

from recpipe.pipeline.topology import LayoutError, NodeLayout, node_layout, planner_topology


def _torchrun_env(nodes: int, per_node: int, rank: int) -> dict[str, str]:
    """What torchrun sets for ``rank`` of ``nodes`` nodes of ``per_node`` processes."""
    return {"WORLD_SIZE": str(nodes * per_node), "RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
            "GROUP_RANK": str(rank // per_node), "LOCAL_WORLD_SIZE": str(per_node)}


@pytest.mark.parametrize("nodes, per_node, local_groups, spanning", [
    (2, 2, [[0, 1], [2, 3]], [[1, 2], [0, 1, 2, 3]]),
    (1, 4, [[0, 1, 2, 3], [1, 3]], []),
    (4, 1, [[0], [3]], [[0, 1], [2, 3]]),
])
def test_layouts_from_torchrun_env(nodes: int, per_node: int, local_groups: list, spanning: list) -> None:
    world = nodes * per_node
    for rank in range(world):
        layout = node_layout(world, _torchrun_env(nodes, per_node, rank))
        assert (layout.num_nodes, layout.local_world_size) == (nodes, per_node)
        assert layout.node_of(rank) == rank // per_node
    assert all(layout.node_local(g) for g in local_groups)  # symmetric memory may be used there
    assert not any(layout.node_local(g) for g in spanning)  # NCCL there
    assert str(layout) == f"{nodes} node{'s' * (nodes > 1)} x {per_node} rank(s)"


def test_without_torchrun_every_rank_is_on_one_node() -> None:
    assert node_layout(3, {}) == NodeLayout(3, 3)


@pytest.mark.parametrize("world, env, message", [
    (3, {"LOCAL_WORLD_SIZE": "2"}, "3 ranks do not split into nodes of LOCAL_WORLD_SIZE=2: launch "
                                   "the same --nproc-per-node on every node"),
    (4, {**_torchrun_env(2, 2, 2), "GROUP_RANK": "0"}, "rank 2 is local rank 0 of node 0, not of "
                                                       "nodes of 2 ranks"),
])
def test_unequal_nodes_are_refused_in_one_line(world: int, env: dict, message: str) -> None:
    with pytest.raises(LayoutError) as e:
        node_layout(world, env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_planner_topology_sees_nodes_and_bandwidths() -> None:
    topology = planner_topology(NodeLayout(8, 4), torch.device("cpu"), intra_node_gb_s=450,
                                inter_node_gb_s=50)
    assert (topology.world_size, topology.local_world_size) == (8, 4)
    assert topology.intra_host_bw == pytest.approx(450e6)  # bytes/ms
    assert topology.inter_host_bw == pytest.approx(50e6)
