"""The flat algorithms (one tier: every pair of members is assumed equally far apart), by
name and op, and the cost model's choice among them for a phase of a two-tier algorithm.

Signatures by op (team first; rooted ops expect the root at team index 0):
    all_reduce(team, x, op)        reduce(team, x, op)        broadcast(team, x)
    reduce_scatter(team, x, bounds, op) -> the reduced part   all_gather(team, x, bounds)
    gather(team, x, bounds)        scatter(team, x, bounds)
    all_to_all(team, out, inp, out_bounds, in_bounds)
x is flat and contiguous; `bounds` are per-member element offsets in team order.
"""

from __future__ import annotations

from collections.abc import Callable

from shardtrain.cost import collectives as cost
from shardtrain.comm.algorithms import alltoall, doubling, halving, ring, tree

FLAT: dict[str, dict[str, Callable]] = {
    "ring": {"all_reduce": ring.all_reduce, "reduce_scatter": ring.reduce_scatter,
             "all_gather": ring.all_gather, "broadcast": ring.broadcast, "reduce": ring.reduce,
             "gather": ring.gather, "scatter": ring.scatter, "all_to_all": alltoall.pairwise},
    "tree": {"all_reduce": tree.all_reduce, "reduce": tree.reduce, "broadcast": tree.broadcast,
             "gather": tree.gather, "scatter": tree.scatter},
    "recursive_doubling": {"all_reduce": doubling.all_reduce, "all_gather": doubling.all_gather,
                           "broadcast": doubling.broadcast, "all_to_all": alltoall.bruck},
    # The doubling half of halving-doubling is recursive doubling itself.
    "halving_doubling": {"all_reduce": halving.halving_doubling_all_reduce,
                         "reduce_scatter": halving.reduce_scatter,
                         "all_gather": doubling.all_gather},
    "rabenseifner": {"all_reduce": halving.rabenseifner_all_reduce,
                     "reduce": halving.rabenseifner_reduce},
    "gather_broadcast": {"all_gather": tree.gather_broadcast},
}


def fastest(op: str, nbytes: int, p: int, link: cost.Link) -> Callable:
    """The flat algorithm the cost model prices lowest for this phase."""
    return FLAT[cost.fastest_flat(op, nbytes, p, link)][op]
