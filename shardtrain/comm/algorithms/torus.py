"""Torus collectives: one ring per dimension of a grid (grid.py runs them; cost/topology.py
lays the team out, so runtime and planner agree).

torus2d (seed 001 "2D Torus All-Reduce", after Sony's ImageNet work): an r x c grid whose
rows are c consecutive members -- a node, when the node size splits the team -- and whose
columns join the members with the same position in every row. all_reduce: row ring
reduce-scatter, column ring all-reduce of the row part, row ring all-gather; across nodes
(columns) each member moves only 2(r-1)/r of its 1/c part. reduce_scatter: row, then
column; all_gather: column, then row. A prime team is a 1 x p grid: the column phase
vanishes and the torus is a ring (the cost model does not offer it then).

torus3d (seed 001 "3D Torus All-Reduce": TPU v4's 3-ary 3-cube, Jouppi et al. 2023): a
d0 x d1 x d2 grid, d2 the node size when it splits the team; the same nested rings over
three dimensions: 2(d0 + d1 + d2 - 3) rounds where one ring takes 2(p-1), the same bytes.
A team with fewer than three prime factors has no such grid: a clear error.
"""

from __future__ import annotations

import torch

from shardtrain.cost import topology
from shardtrain.comm.algorithms import grid
from shardtrain.comm.p2p import Team


def local_size(team: Team) -> int:
    """Members per node, or 0 where the nodes differ in size."""
    nodes = team.nodes
    local = nodes.count(nodes[0])
    return local if all(nodes.count(n) == local for n in set(nodes)) else 0


def dims(team: Team, algorithm: str) -> tuple[int, ...]:
    """The team's grid under `algorithm` (torus2d: 1 x p on a prime team)."""
    if algorithm == "torus2d":
        return topology.torus_grid(team.size, local_size(team))
    found = topology.grid_of(algorithm, team.size, local_size(team))
    if found is None:
        raise ValueError(topology.no_grid(algorithm, team.size, team.where))
    return found


def all_reduce(team: Team, x: torch.Tensor, op: str, *, algorithm: str = "torus2d") -> None:
    grid.all_reduce(team, dims(team, algorithm), x, op)


def reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str, *,
                   algorithm: str = "torus2d") -> torch.Tensor:
    """Equal blocks (the op's contract)."""
    return grid.reduce_scatter(team, dims(team, algorithm), x, op)


def all_gather(team: Team, x: torch.Tensor, bounds: list[int], *,
               algorithm: str = "torus2d") -> None:
    grid.all_gather(team, dims(team, algorithm), x)


def ops(algorithm: str) -> dict:
    """The op table of `algorithm` (algorithms/__init__.py)."""
    return {"all_reduce": lambda t, x, op: all_reduce(t, x, op, algorithm=algorithm),
            "reduce_scatter": lambda t, x, b, op: reduce_scatter(t, x, b, op,
                                                                 algorithm=algorithm),
            "all_gather": lambda t, x, b: all_gather(t, x, b, algorithm=algorithm)}
