"""Recursive halving-doubling and Rabenseifner's algorithm (Rabenseifner 2004; Thakur,
Rabenseifner and Gropp 2005, sec. 4.4; seed 001 "Rabenseifner All-Reduce ... an enhanced
naive halving-doubling", seed 000 "Rabenseifner: the best of both worlds").

All-reduce = recursive-halving reduce-scatter + recursive-doubling all-gather: 2 lg p rounds
(the butterfly's latency) moving 2(p-1)/p of the vector (the ring's bandwidth). The two
names differ in the order partners are met, which the alpha-beta model cannot see but a
two-tier network can:

- `rabenseifner` (MPICH's order): distance halving -- the first, largest exchange (n/2) is
  with the farthest member, index ^ p/2; parts end in natural order (member c holds part c).
- `halving_doubling` (Rabenseifner's "recursive vector halving and distance doubling", also
  Gloo's halving-doubling): distance doubling -- the largest exchange is with index ^ 1,
  the nearest member, usually on the same node; member c ends with part bitreverse(c), which
  the all-gather undoes. Its reduce-scatter must leave part c on member c, so that op uses
  the distance-halving order.

Rabenseifner's reduce = recursive-halving reduce-scatter + binomial gather to the root.
"""

from __future__ import annotations

import torch

from shardtrain.comm.algorithms import tree
from shardtrain.comm.algorithms.doubling import (core_bounds, doubling_all_gather, fold,
                                                 halving_reduce_scatter, masks, unfold)
from shardtrain.comm.p2p import Team, even_bounds, part


def _all_reduce(team: Team, x: torch.Tensor, op: str, far_first: bool) -> None:
    core = fold(team, x, op)
    if core is not None:
        bounds = even_bounds(x.numel(), core.size)
        order = masks(core.size, far_first)
        start = halving_reduce_scatter(core, x, bounds, op, order)
        doubling_all_gather(core, x, bounds, start, order[::-1])
    unfold(team, x)


def rabenseifner_all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    _all_reduce(team, x, op, far_first=True)


def halving_doubling_all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    _all_reduce(team, x, op, far_first=False)


def reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str) -> torch.Tensor:
    """Recursive halving (x stays intact: it works on a copy); a folded member's part comes
    back from its even partner."""
    x = team.scratch("halving.copy", x.numel(), x.dtype).copy_(x)
    core = fold(team, x, op)
    if core is not None:
        halving_reduce_scatter(core, x, core_bounds(bounds, team.size), op,
                               masks(core.size, far_first=True))
    unfold(team, x, bounds)
    return part(x, bounds, team.index)


def rabenseifner_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    """To index 0 (in the core whatever p is): halving reduce-scatter, binomial gather."""
    core = fold(team, x, op)
    if core is not None:
        bounds = even_bounds(x.numel(), core.size)
        halving_reduce_scatter(core, x, bounds, op, masks(core.size, far_first=True))
        tree.gather(core, x, bounds)
