"""Recursive doubling (the seeds' "Butterfly All-Reduce"), recursive halving, and the folding
that lets both run on any number of ranks.

Butterfly all-reduce (seed 000; seed 001 "Butterfly Reduce: lg N rounds, S data per round"):
in round k every member swaps its whole vector with member index ^ 2^k and reduces, so after
lg p rounds all hold the result; every member is busy in every round (unlike the tree).

Recursive halving reduce-scatter / recursive doubling all-gather (Thakur, Rabenseifner and
Gropp 2005, sec. 4.4 and 4.2): a round halves the range of parts a member is responsible
for (it keeps one half, sends the other to its partner and reduces the partner's copy of
the kept half) -- or, going back up, doubles it. The partner order is a list of masks; the
ranges stay contiguous whatever the order, only which part a member ends with changes.

Non-powers of two (Thakur et al. sec. 4.4, as MPICH does): with r = p - 2^floor(lg p), the
first 2r members pair up, the odd one of each pair hands its vector to the even one (fold),
the power-of-two core runs the algorithm, and the result goes back out (unfold). Member 0
is always in the core, so rooted algorithms built on the core keep their root.

Bruck's all-gather (Bruck et al. 1997; Thakur et al. sec. 4.2) serves all-gather when p is
not a power of two: ceil(lg p) rounds, no folding, at the price of a final local rotation.
"""

from __future__ import annotations

import torch

from shardtrain.comm.algorithms import tree
from shardtrain.comm.p2p import Team, even_bounds, part, reduce_into


def _core(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def fold(team: Team, x: torch.Tensor, op: str) -> Team | None:
    """Fold the 2r extra members into their even partners; the core team, or None for a
    member that sat out (it only waits for `unfold`)."""
    p, i = team.size, team.index
    r = p - _core(p)
    if i < 2 * r:
        if i % 2:
            team.exchange(sends=[(i - 1, x)])
            return None
        tmp = team.scratch("fold", x.numel(), x.dtype)
        team.exchange(recvs=[(i + 1, tmp)])
        reduce_into(x, tmp, op)
    return team.sub([j for j in range(p) if j >= 2 * r or j % 2 == 0])


def unfold(team: Team, x: torch.Tensor, bounds: list[int] | None = None) -> None:
    """Hand results back to the members `fold` set aside: the whole vector, or with `bounds`
    (a reduce-scatter) only the sat-out member's own part."""
    p, i = team.size, team.index
    if i >= 2 * (p - _core(p)):
        return
    mine = x if bounds is None else part(x, bounds, i + 1 - i % 2)
    if i % 2:
        team.exchange(recvs=[(i - 1, mine)])
    else:
        team.exchange(sends=[(i + 1, mine)])


def core_bounds(bounds: list[int], p: int) -> list[int]:
    """Part bounds seen by the core: core member c < r answers for parts 2c and 2c+1."""
    r = p - _core(p)
    return [bounds[2 * c] if c <= r else bounds[c + r] for c in range(_core(p) + 1)]


def masks(p: int, far_first: bool) -> list[int]:
    """Partner distances of a power-of-two team: p/2 .. 1 (far first) or 1 .. p/2."""
    out = [1 << k for k in range(p.bit_length() - 1)]
    return out[::-1] if far_first else out


def halving_reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str,
                           order: list[int]) -> int:
    """On a power-of-two team; returns the part this member ends with, reduced. With masks
    far first, member c ends with part c."""
    lo, hi, c = 0, team.size, team.index
    tmp = team.scratch("halving", x.numel(), x.dtype)  # folded parts: a kept half may exceed n/2
    for mask in order:
        mid = (lo + hi) // 2
        (lo, hi), give = ((mid, hi), (lo, mid)) if c & mask else ((lo, mid), (mid, hi))
        keep = part(x, bounds, lo, hi)
        buf = tmp[:keep.numel()]
        team.exchange(sends=[(c ^ mask, part(x, bounds, *give))], recvs=[(c ^ mask, buf)])
        reduce_into(keep, buf, op)
    return lo


def doubling_all_gather(team: Team, x: torch.Tensor, bounds: list[int], start: int,
                        order: list[int]) -> None:
    """On a power-of-two team: member c holds part `start`; each round swaps the current
    range with the partner's sibling range. `order` reverses the halving that led here."""
    lo, c = start, team.index
    for width, mask in enumerate(order):
        size = 1 << width
        parent = lo - lo % (2 * size)
        other = parent + size if lo == parent else parent
        team.exchange(sends=[(c ^ mask, part(x, bounds, lo, lo + size))],
                      recvs=[(c ^ mask, part(x, bounds, other, other + size))])
        lo = parent


def bruck_all_gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """Any p: a work buffer holds parts i, i+1, ... (mod p); round k copies the first
    min(2^k, p-2^k) of them to member i-2^k and appends as many from member i+2^k."""
    p, i = team.size, team.index
    sizes = [bounds[(i + j) % p + 1] - bounds[(i + j) % p] for j in range(p)]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    work = team.scratch("bruck", x.numel(), x.dtype)
    work[:sizes[0]] = part(x, bounds, i)
    d = 1
    while d < p:
        count = min(d, p - d)
        team.exchange(sends=[((i - d) % p, work[:offsets[count]])],
                      recvs=[((i + d) % p, work[offsets[d]:offsets[d + count]])])
        d <<= 1
    tail = x.numel() - bounds[i]  # undo the rotation: parts i..p-1, then 0..i-1
    x[bounds[i]:] = work[:tail]
    x[:bounds[i]] = work[tail:]


def all_gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """Recursive doubling on a power of two, Bruck's algorithm otherwise."""
    if team.size & (team.size - 1):
        bruck_all_gather(team, x, bounds)
    else:
        doubling_all_gather(team, x, bounds, team.index, masks(team.size, far_first=False))


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    """Butterfly: lg p rounds of whole-vector swaps (plus fold / unfold off powers of two).
    Partners compute a (op) b and b (op) a, which IEEE arithmetic makes identical."""
    core = fold(team, x, op)
    if core is not None:
        tmp = team.scratch("butterfly", x.numel(), x.dtype)
        for mask in masks(core.size, far_first=False):
            partner = core.index ^ mask
            core.exchange(sends=[(partner, x)], recvs=[(partner, tmp)])
            reduce_into(x, tmp, op)
    unfold(team, x)


def broadcast(team: Team, x: torch.Tensor) -> None:
    """Van de Geijn's long-message broadcast: binomial scatter from index 0, then all-gather."""
    bounds = even_bounds(x.numel(), team.size)
    tree.scatter(team, x, bounds)
    all_gather(team, x, bounds)
