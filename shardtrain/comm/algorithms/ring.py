"""Ring algorithms: each member talks only to its neighbours, i+1 (right) and i-1 (left).

all_reduce = reduce_scatter + all_gather, as in the seeds' four-GPU walkthrough (seed 000,
"Ring All-Reduce"; Thakur, Rabenseifner and Gropp 2005, sec. 4.4): p-1 steps in which every
member sends one part right, receives one from the left and reduces it, then p-1 steps in
which the finished parts travel once around the ring. Each member sends 2(p-1)/p of the
vector in 2(p-1) rounds: bandwidth-optimal, latency linear in p.

Pipelining: a part is cut into segments of at most SEGMENT_BYTES. A segment is forwarded
as soon as it is reduced (reduce-scatter) or received (all-gather), so the next segment's
transfer overlaps this one's reduction, and the part reduced at step s starts out for
step s+1 before all of it is reduced. Segment sizes derive from part sizes alone, so
sender and receiver agree on them, and messages between two neighbours match in posting
order. Received segments land in a pool of SLOTS segment buffers, not a part-sized
scratch. A reduce-scatter leaves its input intact by adding the received segment to its
own input into a work buffer in one pass.

Segments are large. Where the ranks share a host's cores (loopback Gloo), sending,
receiving and reducing compete for the same cores, so the overlap buys little, while
every extra message costs wake-ups on both sides. Measured with 4 processes on 2 cores
(ring busbw / native busbw, calls interleaved): parts sent whole beat 2-4 MiB segments in
8 of 9 paired runs at 16 MiB (0.88-1.09 against 0.83-0.95) and in all 4 at 64 MiB
(0.98-1.05 against 0.92-0.98); at 256 MiB, 16 MiB segments gave 1.01-1.04 against
0.99-1.02.

Rooted ring collectives are chains (van de Geijn's long-message forms): gather and scatter
pipeline one part per step along the ring; broadcast = chain scatter + ring all-gather;
reduce = ring reduce-scatter + chain gather. Rooted functions take a team whose root is
index 0 (see Team.rotated); parts are in team order.
"""

from __future__ import annotations

from collections import deque

import torch

from shardtrain.comm.p2p import Team, even_bounds, part, reduce_into

SEGMENT_BYTES = 16 << 20  # parts up to 16 MiB travel whole (see the module doc)
SLOTS = 2  # receive buffers in flight: received segments are reduced out of a small pool


def _segments(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.tensor_split(max(1, -(-t.numel() * t.element_size() // SEGMENT_BYTES))))


def reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str, *,
                   inplace: bool = False) -> torch.Tensor:
    """Member i ends with part i reduced over the team (returned). Step s sends part i-s-1
    and reduces the left neighbour's part i-s-2 into its own; the last step completes part
    i (= i-(p-2)-2 mod p). x is left intact (the sums go to a work buffer) unless `inplace`."""
    work = x if inplace else team.scratch("ring.sums", x.numel(), x.dtype)
    team.wait(_reduce_scatter(team, work, bounds, op, then_gather=False,
                              source=None if inplace else x))
    return part(work, bounds, team.index)


def all_gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """In place on flat x: member i holds part i on entry, every part on exit. Step s
    receives part i-s-1 straight into x and forwards it at step s+1."""
    _all_gather(team, x, bounds, started=None)


def all_reduce(team: Team, x: torch.Tensor, op: str) -> None:
    """Reduce-scatter, then all-gather; the all-gather's first sends leave segment by
    segment as the reduce-scatter completes them, so the phases overlap at the seam."""
    bounds = even_bounds(x.numel(), team.size)
    started = _reduce_scatter(team, x, bounds, op, then_gather=True)
    _all_gather(team, x, bounds, started)


def _reduce_scatter(team: Team, x: torch.Tensor, bounds: list[int], op: str, *,
                    then_gather: bool, source: torch.Tensor | None = None) -> list:
    """The reduce-scatter into x; this member's own contribution is read from `source`
    (default: x itself). With `then_gather`, also sends each finished segment of part i on
    (the all-gather's step 0) and returns those pending sends instead of waiting."""
    p, i = team.size, team.index
    right, left = (i + 1) % p, (i - 1) % p
    source = x if source is None else source
    if p == 1:
        if source is not x:
            part(x, bounds, i).copy_(part(source, bounds, i))
        return []
    # The receive schedule, segment by segment: (step, the segment reduced into, its source).
    items = [(s, dst, own) for s in range(p - 1)
             for dst, own in zip(_segments(part(x, bounds, (i - s - 2) % p)),
                                 _segments(part(source, bounds, (i - s - 2) % p)))]
    width = max(d.numel() for _, d, _ in items)
    pool = team.scratch("ring.pool", SLOTS * width, x.dtype).view(SLOTS, width)

    def receive(t: int):
        buf = pool[t % SLOTS, :items[t][1].numel()]
        return buf, team.post([], [(left, buf)])

    sends = team.post([(right, seg) for seg in _segments(part(source, bounds, (i - 1) % p))], [])
    final = []
    inflight = deque(receive(t) for t in range(min(SLOTS, len(items))))
    for t, (s, dst, own) in enumerate(items):
        buf, pending = inflight.popleft()
        team.wait(pending)
        reduce_into(dst, buf, op, base=own)
        if s < p - 2:  # the segment just reduced is what the next step sends
            sends += team.post([(right, dst)], [])
        elif then_gather:
            final += team.post([(right, dst)], [])
        if t + SLOTS < len(items):  # its buffer is free again
            inflight.append(receive(t + SLOTS))
    team.traffic.rounds += p - 1
    team.wait(sends)  # the parts sent are the ones the all-gather will receive into
    return final


def _all_gather(team: Team, x: torch.Tensor, bounds: list[int], started: list | None) -> None:
    p, i = team.size, team.index
    right, left = (i + 1) % p, (i - 1) % p
    if p == 1:
        return
    sends = started if started is not None else \
        team.post([(right, seg) for seg in _segments(part(x, bounds, i))], [])
    # Every receive is posted up front: each has its own place in x.
    incoming = [(s, seg, team.post([], [(left, seg)]))
                for s in range(p - 1) for seg in _segments(part(x, bounds, (i - s - 1) % p))]
    for s, seg, pending in incoming:
        team.wait(pending)
        if s < p - 2:
            sends += team.post([(right, seg)], [])
    team.traffic.rounds += p - 1
    team.wait(sends)


def gather(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """Chain gather to index 0: member v holds part v; at step t it sends part v+t to v-1
    (its own first, then what v+1 handed it), so the root receives part t+1 at step t."""
    p, v = team.size, team.index
    for t in range(p - 1):
        sends = [(v - 1, part(x, bounds, v + t))] if v > 0 and v + t < p else []
        recvs = [(v + 1, part(x, bounds, v + 1 + t))] if v + 1 + t < p else []
        if sends or recvs:
            team.exchange(sends, recvs)


def scatter(team: Team, x: torch.Tensor, bounds: list[int]) -> None:
    """Chain scatter from index 0 (the mirror of gather): the farthest part leaves first;
    member v receives parts p-1 down to v and passes on every part but its own."""
    p, v = team.size, team.index
    for t in range(p - 1):
        # Part p-1-k leaves the root at step k and reaches member v at step k+v-1.
        sends = [(v + 1, part(x, bounds, p - t + v - 1))] if v + 1 < p and t >= v else []
        recvs = [(v - 1, part(x, bounds, p - t + v - 2))] if v > 0 and t >= v - 1 else []
        if sends or recvs:
            team.exchange(sends, recvs)


def broadcast(team: Team, x: torch.Tensor) -> None:
    bounds = even_bounds(x.numel(), team.size)
    scatter(team, x, bounds)
    all_gather(team, x, bounds)


def reduce(team: Team, x: torch.Tensor, op: str) -> None:
    bounds = even_bounds(x.numel(), team.size)
    reduce_scatter(team, x, bounds, op, inplace=True)
    gather(team, x, bounds)
