"""2D torus collectives (seed 001 "2D Torus All-Reduce", after Sony's ImageNet work): the
team is an r x c grid whose rows are c consecutive members -- a node, when the node size
splits the team (`cost.torus_grid` decides, so runtime and planner agree) -- and whose
columns join the members with the same position in every row.

all_reduce: row ring reduce-scatter, column ring all-reduce of the row part, row ring
all-gather. Across nodes (columns) each member moves only 2(r-1)/r of its 1/c part.
reduce_scatter: row ring reduce-scatter of the column-ordered blocks, then column ring
reduce-scatter. all_gather: the reverse (column, then row). Blocks are permuted once into
column order so that every phase works on contiguous ranges. A prime team is a 1 x p grid:
the column phase vanishes and the torus is a ring (the cost model does not offer it then).
"""

from __future__ import annotations

import torch

from shardtrain.cost import collectives as cost
from shardtrain.comm.algorithms import ring
from shardtrain.comm.p2p import Team, even_bounds


def grid(team: Team) -> tuple[int, int, Team, Team]:
    """(rows, columns, my row team, my column team)."""
    nodes = team.nodes
    local = nodes.count(nodes[0])
    uniform = all(nodes.count(n) == local for n in set(nodes))
    r, c = cost.torus_grid(team.size, local if uniform else 0)
    row, col = divmod(team.index, c)
    return (r, c, team.sub(list(range(row * c, row * c + c))),
            team.sub(list(range(col, team.size, c))))


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    r, c, row, col = grid(team)
    bounds = even_bounds(x.numel(), c)
    mine = ring.reduce_scatter(row, x, bounds, op, inplace=True)
    ring.all_reduce(col, mine, op)
    ring.all_gather(row, x, bounds)


def reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str) -> torch.Tensor:
    """Equal blocks (the op's contract): block b = row * c + column."""
    r, c, row, col = grid(team)
    m = x.numel() // team.size
    work = team.scratch("torus", x.numel(), x.dtype)
    work.view(c, r, m).copy_(x.view(r, c, m).transpose(0, 1))  # by column: [c, r, m]
    column_part = ring.reduce_scatter(row, work, [j * r * m for j in range(c + 1)], op,
                                      inplace=True)
    return ring.reduce_scatter(col, column_part, [i * m for i in range(r + 1)], op,
                               inplace=True)


def all_gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    r, c, row, col = grid(team)
    m = x.numel() // team.size
    i, j = divmod(team.index, c)
    work = team.scratch("torus", x.numel(), x.dtype).view(c, r, m)
    work[j, i] = x.view(r, c, m)[i, j]
    ring.all_gather(col, work[j].view(-1), [k * m for k in range(r + 1)])
    ring.all_gather(row, work.view(-1), [k * r * m for k in range(c + 1)])
    x.view(r, c, m).copy_(work.transpose(0, 1))
