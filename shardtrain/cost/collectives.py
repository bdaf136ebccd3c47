"""The alpha-beta-gamma cost model of collectives, shared by the planner and the runtime.

A message of n bytes over a `Link` costs alpha + n beta (+ n gamma where it is reduced).
Forms follow Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 2005) and Chan et al. 2007; see FORMULAS.md.

Conventions (p ranks, n = `nbytes`):
- n is the full buffer: the vector of all_reduce / reduce / broadcast; the gathered output
  of all_gather and gather; the input of reduce_scatter and scatter; one rank's whole send
  buffer of all_to_all (n/p to each peer). nccl-tests use the same sizes.
- `Cost.sent_bytes` is what the busiest rank sends, `sent_bytes_mean` the average over the
  p ranks (equal for the symmetric algorithms: ring, recursive doubling, Rabenseifner).
  Chunks are the ideal n/p (no padding). `rounds` counts the alpha terms.
- `native` is modelled as the runtime ledger models the backend: ring for all_reduce,
  all_gather and reduce_scatter (NCCL and Gloo use rings for bandwidth-bound sizes),
  pairwise exchange for all_to_all, direct root <-> peer transfers for rooted ops. Its
  rounds cost the link's `native_alpha_s`: the backend's own messages, sent from C++,
  start far sooner than ours (each of our rounds posts and waits from Python). The link's
  `backend` says whose collectives `native` means. On "gloo" (torch's Gloo, on CPUs) ops
  are priced as Gloo runs them: all_gather and gather go through an n-byte temporary
  (gathered into a flat buffer, then copied out) and reduce_scatter all-reduces a clone
  of its input (ProcessGroupGloo.cpp); reduce is a ring reduce-scatter followed by a
  gather to the root (gloo/reduce.cc; priced as our ring reduce); broadcast is a binomial
  tree (gloo/broadcast.cc); gather, scatter and all_to_all post every transfer at once
  and wait once (gloo/gather.cc, scatter.cc, alltoall.cc): one round, not p - 1. The
  copy through the temporary is a local pass (gamma, below); a temporary above glibc's
  largest mmap threshold (STAGED_FRESH_BYTES) is also fresh memory on every call, one
  page fault per 4 KiB page, which is what `staging_s_per_byte` prices.
- Recursive algorithms on a p that is not a power of two fold the r = p - 2^floor(lg p)
  extra ranks into partners first and back out last (Thakur et al. section 4):
  + 2 alpha + 2 n beta + n gamma (less on the way out when only a shard returns).
- `hierarchical` (all_reduce): an intra-node reduce, an all_reduce among the node leaders
  and an intra-node broadcast, each phase with the fastest flat algorithm for its size;
  intra-node phases use `intra`, the leaders `link`; `sent_bytes` is then an upper bound
  (the busiest rank of each phase). The grids -- `torus2d`, `mesh2d`, `torus3d` -- and
  `ring_tree` are priced phase by phase in topology.py (lines inside a node on `intra`,
  across nodes on `link`). Phases that several sub-groups run at once (every row, every
  node) charge the shared medium for all of them.
- `gather_broadcast` (all_gather): seed 002's composite, a binomial gather to rank 0 and a
  binomial broadcast of the whole result; the root sends ceil(lg p) n.
- gamma also prices the local passes some algorithms make over the whole buffer (Bruck's
  rotations and packing, the torus's reordering): a copy, like a reduction, is one
  streaming pass over memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from shardtrain.cost import topology
from shardtrain.cost.link import ZERO, Cost, Link
from shardtrain.cost.topology import concurrent as _concurrent, torus_grid  # noqa: F401

OPS = ("broadcast", "reduce", "gather", "scatter", "all_reduce", "all_gather",
       "reduce_scatter", "all_to_all")
ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "halving_doubling",
              "rabenseifner", "gather_broadcast", "hierarchical", "torus2d", "mesh2d",
              "torus3d", "ring_tree")


class _Terms(NamedTuple):
    rounds: float  # alpha count
    beta: float  # bytes on the critical path
    gamma: float  # bytes reduced on the critical path
    sent_max: float
    sent_total: float  # over all ranks

    def cost(self, p: int, link: Link) -> Cost:
        time = (self.rounds * link.alpha_s + self.beta * link.beta_s_per_byte
                + self.gamma * link.gamma_s_per_byte + self.sent_total * link.shared_s_per_byte)
        return Cost(time_s=time, sent_bytes=self.sent_max, sent_bytes_mean=self.sent_total / p,
                    rounds=int(self.rounds))


def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p)))


# (op, algorithm) -> f(n, p, q = (p-1)/p, lg = ceil(lg p)) ->
#     (rounds, critical-path bytes, reduced bytes, busiest rank's sent, all ranks' sent)
_FORMS: dict[tuple[str, str], Callable[[float, int, float, int], tuple[float, ...]]] = {
    ("broadcast", "linear"): lambda n, p, q, lg: (p - 1, (p - 1) * n, 0, (p - 1) * n, (p - 1) * n),
    ("scatter", "linear"): lambda n, p, q, lg: (p - 1, q * n, 0, q * n, q * n),
    ("gather", "linear"): lambda n, p, q, lg: (p - 1, q * n, 0, n / p, q * n),
    ("reduce", "linear"): lambda n, p, q, lg: (p - 1, (p - 1) * n, (p - 1) * n, n, (p - 1) * n),
    ("all_reduce", "ring"): lambda n, p, q, lg: (2 * (p - 1), 2 * q * n, q * n, 2 * q * n,
                                                 2 * (p - 1) * n),
    ("all_gather", "ring"): lambda n, p, q, lg: (p - 1, q * n, 0, q * n, (p - 1) * n),
    ("reduce_scatter", "ring"): lambda n, p, q, lg: (p - 1, q * n, q * n, q * n, (p - 1) * n),
    # all_to_all "ring": the pairwise exchange (step i: send to rank + i, receive from rank - i)
    ("all_to_all", "ring"): lambda n, p, q, lg: (p - 1, q * n, 0, q * n, (p - 1) * n),
    # gather / scatter "ring": a pipelined chain, one n/p chunk per rank and step
    ("gather", "ring"): lambda n, p, q, lg: (p - 1, q * n, 0, q * n, (p - 1) * n / 2),
    ("scatter", "ring"): lambda n, p, q, lg: (p - 1, q * n, 0, q * n, (p - 1) * n / 2),
    # broadcast = scatter + all_gather, reduce = reduce_scatter + gather (van de Geijn)
    ("broadcast", "ring"): lambda n, p, q, lg: (2 * (p - 1), 2 * q * n, 0, 2 * q * n,
                                                1.5 * (p - 1) * n),
    ("reduce", "ring"): lambda n, p, q, lg: (2 * (p - 1), 2 * q * n, q * n, 2 * q * n,
                                             1.5 * (p - 1) * n),
    # binomial trees; all_reduce = reduce + broadcast
    ("broadcast", "tree"): lambda n, p, q, lg: (lg, lg * n, 0, lg * n, (p - 1) * n),
    ("reduce", "tree"): lambda n, p, q, lg: (lg, lg * n, lg * n, n, (p - 1) * n),
    ("scatter", "tree"): lambda n, p, q, lg: (lg, q * n, 0, q * n, lg * n / 2),
    ("gather", "tree"): lambda n, p, q, lg: (lg, q * n, 0, n / 2, lg * n / 2),
    ("all_reduce", "tree"): lambda n, p, q, lg: (2 * lg, 2 * lg * n, lg * n, lg * n,
                                                 2 * (p - 1) * n),
    # recursive doubling (Bruck's variant where p is not a power of two)
    ("all_gather", "recursive_doubling"): lambda n, p, q, lg: (lg, q * n, 0, q * n, (p - 1) * n),
    ("all_gather", "halving_doubling"): lambda n, p, q, lg: (lg, q * n, 0, q * n, (p - 1) * n),
    ("broadcast", "recursive_doubling"): lambda n, p, q, lg: (  # binomial scatter + all_gather
        2 * lg, 2 * q * n, 0, 2 * q * n, lg * n / 2 + (p - 1) * n),
    # Bruck (Bruck et al. 1997; Thakur et al. 2005 sec. 4.5 keep it for short messages):
    # besides lg rounds of about n/2 bytes, local passes over the buffer priced at gamma --
    # a rotation in, packing and unpacking n/2 per round, the inverse rotation out
    ("all_to_all", "recursive_doubling"): lambda n, p, q, lg: (
        lg, lg * n / 2, (lg + 2) * n, lg * n / 2, p * lg * n / 2),
    # binomial gather + binomial broadcast; the root sends the most: lg n
    ("all_gather", "gather_broadcast"): lambda n, p, q, lg: (
        2 * lg, q * n + lg * n, 0, lg * n, lg * n / 2 + (p - 1) * n),
}

# Reducing recursive algorithms on the power-of-two core c of p ranks: (terms as above,
# bytes returned to each folded rank at the end).
_FOLDED: dict[tuple[str, str], Callable[[float, int, float, int, int], tuple[tuple, float]]] = {
    ("all_reduce", "recursive_doubling"): lambda n, c, q, lg, p: (
        (lg, lg * n, lg * n, lg * n, c * lg * n), n),
    ("reduce_scatter", "halving_doubling"): lambda n, c, q, lg, p: (
        (lg, q * n, q * n, q * n, (c - 1) * n), n / p),
    ("all_reduce", "halving_doubling"): lambda n, c, q, lg, p: (
        (2 * lg, 2 * q * n, q * n, 2 * q * n, 2 * (c - 1) * n), n),
    ("all_reduce", "rabenseifner"): lambda n, c, q, lg, p: (
        (2 * lg, 2 * q * n, q * n, 2 * q * n, 2 * (c - 1) * n), n),
    ("reduce", "rabenseifner"): lambda n, c, q, lg, p: (  # halving reduce_scatter + binomial gather
        (2 * lg, 2 * q * n, q * n, q * n + n / 2, (c - 1) * n + lg * n / 2), 0.0),
}


def _flat_terms(op: str, algorithm: str, n: float, p: int) -> _Terms:
    if (op, algorithm) in _FORMS:
        return _Terms(*_FORMS[(op, algorithm)](n, p, (p - 1) / p, _lg(p)))
    core = 1 << (p.bit_length() - 1)
    (rounds, beta, gamma, sent_max, total), back = _FOLDED[(op, algorithm)](
        n, core, (core - 1) / core, _lg(core), p)
    if core < p:  # fold in: extra ranks send n to a partner; fold out: `back` returns
        rounds += 1 + (back > 0)
        beta, gamma = beta + n + back, gamma + n
        sent_max, total = max(sent_max + back, n), total + (p - core) * (n + back)
    return _Terms(rounds, beta, gamma, sent_max, total)


_NATIVE = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring",
           "all_to_all": "ring", "broadcast": "linear", "reduce": "linear",
           "gather": "linear", "scatter": "linear"}
STAGED_FRESH_BYTES = 32 << 20  # glibc's mmap threshold rises to at most this (mallopt(3))
# Gloo: op -> (the op it runs, our model of it) where not _NATIVE's; the ops it stages.
_GLOO = {"reduce_scatter": ("all_reduce", "ring"), "reduce": ("reduce", "ring"),
         "broadcast": ("broadcast", "tree")}
_STAGED = ("all_gather", "gather", "reduce_scatter")
_POSTED = ("gather", "scatter", "all_to_all")  # Gloo posts every transfer at once: one round
_FLAT = ("ring", "tree", "recursive_doubling", "halving_doubling", "rabenseifner",
         "gather_broadcast")


def supported(op: str, p: int, local_size: int = 0) -> tuple[str, ...]:
    """The algorithms `cost` accepts for this op, group size and node size."""
    _check_op(op)
    out = ["native"] + [a for a in _FLAT if (op, a) in _FORMS or (op, a) in _FOLDED]
    if op == "all_reduce" and 1 < local_size < p and p % local_size == 0:
        out.append("hierarchical")
    out += [a for a, ops in topology.GRID_OPS.items()
            if op in ops and topology.grid_of(a, p, local_size) is not None]
    return tuple(out)


def cost(op: str, nbytes: float, p: int, link: Link, *, algorithm: str = "native",
         intra: Link | None = None, local_size: int = 0) -> Cost:
    """Time and bytes of one collective. `link` is what flat algorithms cross (the slowest
    tier of the group); `intra` and `local_size` describe the node for the two-tier ones."""
    _check_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if p <= 1 or nbytes <= 0:
        return ZERO
    if algorithm not in supported(op, p, local_size):
        raise ValueError(f"algorithm {algorithm!r} does not implement {op} on {p} ranks "
                         f"(node size {local_size}); use one of "
                         f"{', '.join(supported(op, p, local_size))}")
    intra = intra or link
    if algorithm == "hierarchical":
        return _hierarchical(nbytes, p, link, intra, local_size)
    if algorithm in topology.GRID_OPS:
        return topology.price(algorithm, op, nbytes, p, link, intra, local_size,
                              _phase, _line)
    if algorithm == "native":
        return _native(op, nbytes, p, link)
    return _flat_terms(op, algorithm, nbytes, p).cost(p, link)


def _native(op: str, n: float, p: int, link: Link) -> Cost:
    """The backend's own collective: our model of its algorithm at its own latency, plus
    its staging (module doc) where it stages."""
    own = dataclasses.replace(link, alpha_s=link.native_alpha_s)
    if link.backend != "gloo":
        return _flat_terms(op, _NATIVE[op], n, p).cost(p, own)
    terms = _flat_terms(*_GLOO.get(op, (op, _NATIVE[op])), n, p)
    ran = (terms._replace(rounds=1) if op in _POSTED else terms).cost(p, own)
    if op not in _STAGED:
        return ran
    fresh = n if n > STAGED_FRESH_BYTES else 0.0
    return dataclasses.replace(ran, time_s=ran.time_s + n * link.gamma_s_per_byte
                               + fresh * link.staging_s_per_byte)


def best_algorithm(op: str, nbytes: float, p: int, link: Link, *, intra: Link | None = None,
                   local_size: int = 0, native: bool = False) -> str:
    """The fastest algorithm (ties: the first in ALGORITHMS); `native`: the backend's own
    may be chosen too (the runtime's `auto`), else only ours (a phase of a two-tier
    algorithm; the planner, which names the algorithm it prices)."""
    return _best(op, float(nbytes), p, link, intra, local_size, native)


@lru_cache(maxsize=65536)
def _best(op: str, nbytes: float, p: int, link: Link, intra: Link | None,
          local_size: int, native: bool) -> str:
    candidates = [a for a in supported(op, p, local_size) if native or a != "native"]
    return min(candidates, key=lambda a: cost(op, nbytes, p, link, algorithm=a, intra=intra,
                                              local_size=local_size).time_s)


def fastest_flat(op: str, nbytes: float, p: int, link: Link) -> str:
    """The cheapest one-tier algorithm (ties: the first in ALGORITHMS): what a phase of
    `hierarchical` runs (comm/algorithms/flat.py) and is priced at."""
    flat = [a for a in supported(op, p) if a in _FLAT]
    return min(flat, key=lambda a: cost(op, nbytes, p, link, algorithm=a).time_s)


def _fastest_flat(op: str, nbytes: float, p: int, link: Link) -> Cost:
    return cost(op, nbytes, p, link, algorithm=fastest_flat(op, nbytes, p, link))


def _hierarchical(n: float, p: int, link: Link, intra: Link, k: int) -> Cost:
    leaders = _fastest_flat("all_reduce", n, p // k, link)
    # only the p / k leaders (one rank in k) take part in the middle phase
    leaders = dataclasses.replace(leaders, sent_bytes_mean=leaders.sent_bytes_mean / k)
    nodes = _concurrent(intra, p // k)  # every node reduces and broadcasts at once
    return (_fastest_flat("reduce", n, k, nodes) + leaders
            + _fastest_flat("broadcast", n, k, nodes))


def _phase(op: str, algorithm: str, n: float, p: int, link: Link) -> Cost:
    """A flat phase of a grid algorithm."""
    return cost(op, n, p, link, algorithm=algorithm)


def _line(n: float, size: int, link: Link) -> Cost:
    """A line all-reduce (mesh2d's rows and columns): topology.line_terms."""
    return _Terms(*topology.line_terms(n, size)).cost(size, link) if size > 1 else ZERO


def bus_bandwidth(op: str, nbytes: float, p: int, time_s: float) -> float:
    """nccl-tests busbw: algbw = n / t scaled by 2(p-1)/p (all_reduce), (p-1)/p (all_gather,
    reduce_scatter, all_to_all) or 1 (rooted ops), comparable with the link bandwidth."""
    _check_op(op)
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p,
              "reduce_scatter": (p - 1) / p, "all_to_all": (p - 1) / p}.get(op, 1.0)
    return nbytes / time_s * factor


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")
