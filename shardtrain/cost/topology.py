"""The collectives that follow the machine's shape, priced phase by phase from the flat
forms of collectives.py: two tiers (`ring_tree`) and grids (`torus2d`,
`mesh2d`, `torus3d`). The grids are decided here, so the runtime (comm/algorithms/) and
the planner agree on them.

A grid is row-major: the last dimension varies fastest, so a line along it is a run of
consecutive ranks -- a node, when the node size is that dimension. A line along dimension
k spans prod(dims[k:]) consecutive ranks; its phase runs on `intra` when that span fits in
a node (the node size is a multiple of it), else on `link`. Every line of a dimension runs
its phase at once (`concurrent`: on a shared medium their bytes add up).

- torus2d (seed 001, "2D Torus All-Reduce"): r x c, c = the node size when it splits p.
- mesh2d (seed 001, "2D Mesh All-Reduce": the torus without the links that close each row
  and column): the same r x c grid; a row all-reduce, then a column all-reduce, each of
  the whole vector on a line (see `line_terms`).
- torus3d (seed 001, "3D Torus All-Reduce", TPU v4's 3-ary 3-cube, Jouppi et al. 2023):
  d0 x d1 x d2, every d >= 2; one ring per dimension, nested as in the 2D torus.
- ring_tree (seed 004: NCCL rings inside nodes and trees across them): nodes of k ranks,
  a ring reduce-scatter inside each node, a binomial-tree all-reduce of each 1/k part
  across the nodes (k trees at once), a ring all-gather inside each node.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from shardtrain.config.parallel import grid_exists, no_grid  # noqa: F401 (re-exported)
from shardtrain.cost.link import Cost, Link

GRID_OPS = {"torus2d": ("all_reduce", "all_gather", "reduce_scatter"),
            "mesh2d": ("all_reduce",), "torus3d": ("all_reduce", "all_gather", "reduce_scatter"),
            "ring_tree": ("all_reduce",)}
# The forms of one flat phase: (op, algorithm, bytes, ranks, link) -> Cost
Flat = Callable[[str, str, float, int, Link], Cost]


def torus_grid(p: int, local_size: int = 0) -> tuple[int, int]:
    """(rows r, columns c) with r x c = p: c = local_size when it splits p, else the most
    nearly square factorisation. r == 1 means no 2D grid exists."""
    if 1 < local_size < p and p % local_size == 0:
        return p // local_size, local_size
    r = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return r, p // r


def cube_grid(p: int, local_size: int = 0) -> tuple[int, int, int] | None:
    """(d0, d1, d2), outer to inner, every d >= 2, product p: d2 = local_size when it splits
    p and the rest has a 2D grid, else the most nearly cubic. None: p has fewer than three
    prime factors (2, 4, 6, 9, ... ranks make no 3D torus)."""
    if 1 < local_size < p and p % local_size == 0:
        r, c = torus_grid(p // local_size)
        if r > 1:
            return r, c, local_size
    cubes = [(a, b, p // (a * b)) for a in range(2, p) for b in range(a, p)
             if a * b * b <= p and p % (a * b) == 0]
    return min(cubes, key=lambda d: d[2] - d[0], default=None)


def grid_of(algorithm: str, p: int, local_size: int = 0) -> tuple[int, ...] | None:
    """The grid (outer to inner) a grid algorithm lays p ranks on, or None where it has
    none (a 2D grid needs p composite; a 3D torus three factors >= 2; ring_tree nodes of
    equal size, more than one)."""
    if algorithm in ("torus2d", "mesh2d", "torus3d"):
        if not grid_exists(algorithm, p):
            return None
        return torus_grid(p, local_size) if algorithm != "torus3d" else cube_grid(p, local_size)
    if algorithm == "ring_tree":
        return (p // local_size, local_size) if 1 < local_size < p and p % local_size == 0 \
            else None
    raise ValueError(f"{algorithm!r} is not a grid algorithm")


def link_bytes(algorithm: str, n: float, p: int, local_size: int = 0) -> dict[tuple, float]:
    """The all-reduce's bytes on each directed link (sender, receiver), in group ranks, of
    a torus or mesh: a ring phase on a part of s bytes sends 2(d-1)/d s to the next member
    of its line (reduce-scatter and all-gather, or the outermost all-reduce); a mesh line
    sends n each way between neighbours (mesh.py). What the ledger's `sent_to` counts."""
    if algorithm not in ("torus2d", "mesh2d", "torus3d"):
        raise ValueError(f"link_bytes covers the tori and the mesh, not {algorithm!r}")
    dims = grid_of(algorithm, p, local_size)
    out: dict[tuple, float] = {}
    size = n
    for k in reversed(range(len(dims))):  # innermost line first
        d, stride = dims[k], math.prod(dims[k + 1:])
        for r in range(p):
            c = r // stride % d
            steps = (-1, 1) if algorithm == "mesh2d" else ((c + 1) % d - c,)
            for step in steps:
                if 0 <= c + step < d:
                    link = (r, r + step * stride)
                    out[link] = out.get(link, 0.0) + (
                        n if algorithm == "mesh2d" else 2 * (d - 1) / d * size)
        size = size if algorithm == "mesh2d" else size / d
    return out


def concurrent(link: Link, groups: int) -> Link:
    """The link of a phase that `groups` sub-groups run at once: on a shared medium their
    bytes add up (a phase is priced on one sub-group's)."""
    if not link.shared_s_per_byte or groups == 1:
        return link
    return dataclasses.replace(link, shared_s_per_byte=link.shared_s_per_byte * groups)


def _tiers(dims: tuple[int, ...], p: int, link: Link, intra: Link, local_size: int) -> list[Link]:
    """Per dimension, the link its lines run on (module doc), with every line at once."""
    out = []
    for k, d in enumerate(dims):
        span = math.prod(dims[k:])
        inside = local_size > 0 and local_size % span == 0
        out.append(concurrent(intra if inside else link, p // d))
    return out


def line_terms(n: float, size: int) -> tuple[float, ...]:
    """A line all-reduce of n bytes over `size` ranks without a wrap-around link
    (comm/algorithms/mesh.py): a bidirectional reduce-scatter (part j flows to its owner j
    from both ends) and the reverse all-gather, one part n/size per directed link and step.
    Every directed link carries exactly n bytes; each phase takes size - 1 steps. Member i
    sends size - 1 parts in the reduce-scatter, and (i + 1) + (size - i) in the all-gather
    (fewer at the ends), reducing as many: an interior member sends 2n in all.
    (rounds, critical-path bytes, reduced bytes, busiest rank's sent, all ranks' sent)."""
    q = n / size
    busiest = size + 1 if size > 2 else 1  # parts an interior (an end) member handles
    return (2 * (size - 1), 2 * (size - 1) * q, busiest * q, (size - 1 + busiest) * q,
            2 * (size - 1) * n)


def price(algorithm: str, op: str, n: float, p: int, link: Link, intra: Link,
          local_size: int, flat: Flat, line: Callable[[float, int, Link], Cost]) -> Cost:
    """One call of a grid algorithm (`grid_of` has found its grid): `flat` prices a flat
    phase, `line` a line all-reduce (collectives.py)."""
    dims = grid_of(algorithm, p, local_size)
    tiers = _tiers(dims, p, link, intra, local_size)
    if algorithm == "mesh2d":  # rows (inner) first, then columns, each on the whole vector
        return line(n, dims[1], tiers[1]) + line(n, dims[0], tiers[0])
    if op == "all_reduce":  # reduce-scatter inner to outer, the outer line's all-reduce,
        down, up, size = [], [], n  # all-gather outer to inner
        for d, on in zip(dims[:0:-1], tiers[:0:-1]):
            down.append(flat("reduce_scatter", "ring", size, d, on))
            up.append(flat("all_gather", "ring", size, d, on))
            size /= d
        middle = flat("all_reduce", "tree" if algorithm == "ring_tree" else "ring", size,
                      dims[0], tiers[0])
        return sum(down + up, middle)
    # reduce_scatter and all_gather permute the n-byte buffer between grid orders once
    # (algorithms/grid.py), a local pass priced at gamma
    permute = Cost(time_s=n * intra.gamma_s_per_byte, sent_bytes=0.0, sent_bytes_mean=0.0,
                   rounds=0)
    phases, size = [], n
    for d, on in zip(dims[::-1], tiers[::-1]):  # inner dimension first
        phases.append(flat(op, "ring", size, d, on))
        size /= d
    return sum(phases, permute)
