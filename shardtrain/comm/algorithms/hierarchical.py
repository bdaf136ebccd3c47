"""Hierarchical all-reduce (seed 000 "Solution: Hierarchical All-Reduce"; seed 001 after Jia
et al. 2018, "ImageNet in Four Minutes"): intra-node reduce to one leader per node, an
all-reduce among the leaders across nodes, an intra-node broadcast. Only the leaders' traffic
crosses nodes: with k members per node the inter-node phase carries the vector once per node
instead of once per member.

Nodes come from the team's node ids (the mesh's node topology; virtual nodes on one
machine), may differ in size, and need not divide anything. Each phase runs the flat
algorithm the cost model prices lowest for its size, as the planner assumes.
"""

from __future__ import annotations

import torch

from shardtrain.comm.algorithms.flat import fastest
from shardtrain.comm.p2p import Team


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    by_node: dict[int, list[int]] = {}
    for index, node in enumerate(team.nodes):
        by_node.setdefault(node, []).append(index)
    local = team.sub(by_node[team.nodes[team.index]])  # leader: index 0 of its node
    leaders = team.sub([members[0] for members in by_node.values()])
    nbytes = x.numel() * x.element_size()
    fastest("reduce", nbytes, local.size, team.link)(local, x, op)
    if leaders is not None:
        fastest("all_reduce", nbytes, leaders.size, team.link)(leaders, x, op)
    fastest("broadcast", nbytes, local.size, team.link)(local, x)
