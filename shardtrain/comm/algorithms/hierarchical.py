"""Two-tier all-reduces.

hierarchical (seed 000 "Solution: Hierarchical All-Reduce"; seed 001 after Jia et al.
2018, "ImageNet in Four Minutes"): intra-node reduce to one leader per node, an
all-reduce among the leaders across nodes, an intra-node broadcast. Only the leaders' traffic
crosses nodes: with k members per node the inter-node phase carries the vector once per node
instead of once per member.

Nodes come from the team's node ids (the mesh's node topology; virtual nodes on one
machine), may differ in size, and need not divide anything. Each phase runs the flat
algorithm the cost model prices lowest for its size, as the planner assumes.

ring_tree (seed 004: NCCL runs rings inside nodes and trees across them): fixed phases, not
chosen by price. A ring reduce-scatter inside each node leaves each member 1/k of the
vector (k members per node); the members with the same place in their nodes all-reduce
that part with a binomial tree (reduce, then broadcast: 2 lg(nodes) rounds, the tree's
low latency where latency is high); a ring all-gather inside each node. Nodes must be of
one size; a single node is the ring alone.
"""

from __future__ import annotations

import torch

from shardtrain.comm.algorithms import grid, ring, tree
from shardtrain.comm.algorithms.flat import fastest
from shardtrain.comm.algorithms.torus import local_size
from shardtrain.comm.p2p import Team
from shardtrain.cost import topology


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


def ring_tree(team: Team, x: torch.Tensor, op: str) -> None:
    k = local_size(team)
    if k == team.size:
        ring.all_reduce(team, x, op)
        return
    dims = topology.grid_of("ring_tree", team.size, k)
    if dims is None:
        raise ValueError(topology.no_grid("ring_tree", team.size, team.where))
    grid.all_reduce(team, dims, x, op, outer=tree.all_reduce)
