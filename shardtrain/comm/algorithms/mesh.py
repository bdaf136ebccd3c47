"""2D mesh all-reduce (seed 001 "2D Mesh All-Reduce"): the torus2d grid (torus.py) without
the links that close each row and column into a ring, so every row and column is a line.
As the seed draws it: a row all-reduce, then a column all-reduce of the whole result, each
along its line.

A line all-reduce cannot send around a ring; it sends both ways instead. Reduce-scatter:
part j flows towards its owner j from both ends at once -- member i passes part
size-1-s+i rightwards and part s+i-size+1 leftwards at step s, each the partial sum of
its side -- and the owner adds the two partials to its own at the last step. All-gather:
the reverse, each part flowing out from its owner both ways. Each phase takes size - 1
steps of one part (n / size) per directed link, every directed link carries n bytes per
all-reduce (a ring's links carry 2(size-1)/size n, one way), and each part is reduced by
its owner alone, so every member ends with the same bits. cost/topology.line_terms prices
it; the ledger counts the same bytes.
"""

from __future__ import annotations

import torch

from shardtrain.comm.algorithms import torus
from shardtrain.comm.algorithms.grid import lines
from shardtrain.comm.p2p import Team, even_bounds, part, reduce_into


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    across, along = lines(team, torus.dims(team, "mesh2d"))  # the column, the row
    line_all_reduce(along, x, op)
    line_all_reduce(across, x, op)


def line_all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    bounds = even_bounds(x.numel(), team.size)
    _reduce_scatter(team, x, bounds, op)
    _all_gather(team, x, bounds)


def _reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str) -> None:
    """In place: member i ends with part i reduced; its other parts hold partial sums."""
    size, i = team.size, team.index
    width = max(bounds[j + 1] - bounds[j] for j in range(size))
    from_left = team.scratch("line.left", width, x.dtype)
    from_right = team.scratch("line.right", width, x.dtype)
    for s in range(size - 1):
        sends, recvs, adds = [], [], []
        if i < size - 1 and s >= i:  # rightwards: the left side's partial of part j > i
            sends.append((i + 1, part(x, bounds, size - 1 - s + i)))
        if i > 0 and s >= size - 1 - i:  # leftwards: the right side's partial of part j < i
            sends.append((i - 1, part(x, bounds, s + i - size + 1)))
        if i > 0 and s >= i - 1:
            j = size - 2 - s + i
            recvs.append((i - 1, buf := from_left[:bounds[j + 1] - bounds[j]]))
            adds.append((j, buf))
        if i < size - 1 and s >= size - 2 - i:
            j = s + i - size + 2
            recvs.append((i + 1, buf := from_right[:bounds[j + 1] - bounds[j]]))
            adds.append((j, buf))
        team.exchange(sends, recvs)
        for j, buf in adds:  # own part, last step: (own + left) + right on every line
            reduce_into(part(x, bounds, j), buf, op)


def _all_gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """In place: member i holds part i on entry, every part on exit."""
    size, i = team.size, team.index
    for s in range(size - 1):
        sends, recvs = [], []
        if i < size - 1 and i - s >= 0:
            sends.append((i + 1, part(x, bounds, i - s)))
        if i > 0 and i + s <= size - 1:
            sends.append((i - 1, part(x, bounds, i + s)))
        if i > 0 and i - 1 - s >= 0:
            recvs.append((i - 1, part(x, bounds, i - 1 - s)))
        if i < size - 1 and i + 1 + s <= size - 1:
            recvs.append((i + 1, part(x, bounds, i + 1 + s)))
        team.exchange(sends, recvs)
