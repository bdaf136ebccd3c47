"""Collectives on a grid of lines, one line per dimension: the machinery of the torus
algorithms (torus.py: torus2d, torus3d) and of ring_tree (hierarchical.py).

The team is a d0 x d1 x ... array in row-major order (cost/topology.py decides the dims,
so runtime and planner agree): member index = sum of coordinate x stride, the last
dimension varying fastest. A member's line along dimension k is the members that share
all its other coordinates.

all_reduce: a ring reduce-scatter along the innermost line, the same on this member's part
along the next line outwards, ..., an all-reduce of the last part along the outermost line
(a ring, or `outer`), then ring all-gathers back inwards. Each member sends 2(p-1)/p of
the vector, as in one ring over all p, in 2 sum(d - 1) rounds instead of 2(p - 1).
reduce_scatter / all_gather (equal blocks, block b for member b): the blocks are permuted
once into the reversed grid order, so that every phase works on contiguous ranges, then
one ring reduce-scatter per line, innermost first (all-gather: the reverse).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardtrain.comm.algorithms import ring
from shardtrain.comm.p2p import Team, even_bounds


def lines(team: Team, dims: tuple[int, ...]) -> list[Team]:
    """Per dimension k (outer first), this member's line along k, in coordinate order."""
    out = []
    for k, d in enumerate(dims):
        stride = math.prod(dims[k + 1:])
        coordinate = team.index // stride % d
        base = team.index - coordinate * stride
        out.append(team.sub([base + j * stride for j in range(d)]))
    return out


def coordinates(team: Team, dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(team.index // math.prod(dims[k + 1:]) % d for k, d in enumerate(dims))


def all_reduce(team: Team, dims: tuple[int, ...], x: torch.Tensor, op: str, *,
               outer: Callable = ring.all_reduce) -> None:
    _nested(lines(team, dims)[::-1], x, op, outer)


def _nested(inner_first: list[Team], x: torch.Tensor, op: str, outer: Callable) -> None:
    if len(inner_first) == 1:
        outer(inner_first[0], x, op)
        return
    line = inner_first[0]
    bounds = even_bounds(x.numel(), line.size)
    mine = ring.reduce_scatter(line, x, bounds, op, inplace=True)
    _nested(inner_first[1:], mine, op, outer)
    ring.all_gather(line, x, bounds)


def _order(dims: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of [*dims, m] into the reversed grid order [*dims[::-1], m]."""
    n = len(dims)
    return (*range(n - 1, -1, -1), n)


def reduce_scatter(team: Team, dims: tuple[int, ...], x: torch.Tensor, op: str) -> torch.Tensor:
    """Equal blocks (the op's contract); returns this member's reduced block."""
    m = x.numel() // team.size
    work = team.scratch("torus", x.numel(), x.dtype)
    work.view(*dims[::-1], m).copy_(x.view(*dims, m).permute(*_order(dims)))
    for line in lines(team, dims)[::-1]:  # innermost first: blocks grouped by its coordinate
        work = ring.reduce_scatter(line, work, even_bounds(work.numel(), line.size), op,
                                   inplace=True)
    return work


def all_gather(team: Team, dims: tuple[int, ...], x: torch.Tensor) -> None:
    """In place on flat x: member i holds block i on entry, every block on exit."""
    m, n = x.numel() // team.size, len(dims)
    mine = coordinates(team, dims)
    work = team.scratch("torus", x.numel(), x.dtype).view(*dims[::-1], m)
    work[mine[::-1]] = x.view(*dims, m)[mine]
    for k, line in enumerate(lines(team, dims)):  # outermost first, on the finest blocks
        sub = work[mine[::-1][:n - 1 - k]].reshape(-1)  # a view: leading indices only
        ring.all_gather(line, sub, even_bounds(sub.numel(), line.size))
    x.view(*dims, m).copy_(work.permute(*_order(dims[::-1])))
