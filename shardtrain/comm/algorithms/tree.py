"""Binomial trees (MPICH's short-message algorithms; Thakur, Rabenseifner and Gropp 2005,
sec. 4.1-4.3). The seeds' "Tree All-Reduce" (seed 000): pair up and combine in rounds like a
tournament bracket (upward phase, a binomial reduce), then send the answer back down
(downward phase, a binomial broadcast): 2 lg p rounds, each carrying the whole vector.

Member v's parent is v with its lowest set bit cleared; its children are v + 2^k for the
2^k below that bit. The root is index 0 (callers rotate the team, see Team.rotated), and
subtree [v, v + lowbit(v)) is contiguous in team order, which is why scatter and gather
move one contiguous range per edge.
"""

from __future__ import annotations

import torch

from shardtrain.comm.p2p import Team, part, reduce_into


def _lowbit(v: int, p: int) -> int:
    """The size of v's subtree span: its lowest set bit (p's next power of two for the root)."""
    return v & -v if v else 1 << (p - 1).bit_length()


def broadcast(team: Team, x: torch.Tensor) -> None:
    p, v = team.size, team.index
    span = _lowbit(v, p)
    if v:
        team.exchange(recvs=[(v - span, x)])
    mask = span >> 1
    while mask:
        if v + mask < p:
            team.exchange(sends=[(v + mask, x)])
        mask >>= 1


def reduce(team: Team, x: torch.Tensor, op: str) -> None:
    """The root (index 0) ends with the reduction; other members' x is scratch."""
    p, v = team.size, team.index
    tmp = team.scratch("tree", x.numel(), x.dtype)
    mask = 1
    while mask < p:
        if v & mask:
            team.exchange(sends=[(v - mask, x)])
            return
        if v + mask < p:
            team.exchange(recvs=[(v + mask, tmp)])
            reduce_into(x, tmp, op)
        mask <<= 1


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    reduce(team, x, op)
    broadcast(team, x)


def scatter(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """The root holds every part; member v ends with its subtree's parts, its own included."""
    p, v = team.size, team.index
    span = _lowbit(v, p)
    if v:
        team.exchange(recvs=[(v - span, part(x, bounds, v, min(v + span, p)))])
    mask = span >> 1
    while mask:
        if v + mask < p:
            team.exchange(sends=[(v + mask, part(x, bounds, v + mask, min(v + 2 * mask, p)))])
        mask >>= 1


def gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """Member v holds part v; the root ends with all parts (the mirror of scatter)."""
    p, v = team.size, team.index
    mask = 1
    while mask < p:
        if v & mask:
            team.exchange(sends=[(v - mask, part(x, bounds, v, min(v + mask, p)))])
            return
        if v + mask < p:
            team.exchange(recvs=[(v + mask, part(x, bounds, v + mask, min(v + 2 * mask, p)))])
        mask <<= 1


def gather_broadcast(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """All-gather as seed 002 composes it: a gather to index 0, then a broadcast of the
    whole. The root sends ceil(lg p) copies of the full result where a ring member sends
    (p-1)/p of it once: the composite is latency's form, not bandwidth's."""
    gather(team, x, bounds)
    broadcast(team, x)
