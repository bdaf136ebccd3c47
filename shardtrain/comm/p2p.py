"""The point-to-point layer every algorithm is written on: a Wire per collective call, a Team
(an ordered subset of the group) per algorithm phase, and the element-wise reduction.

A Wire posts sends and receives over the communicator's process group with
`torch.distributed.batch_isend_irecv`, waits for them with the group's timeout, and counts
what this rank puts on and takes off the wire: those counts are the ledger's bytes, so the
ledger reports what an algorithm really moved, not what a formula says it should.

Algorithms address peers by Team index. A Team maps indices to group ranks, which lets one
algorithm run on a row of a torus, on the leaders of the nodes, or on a team rotated so the
root of a rooted collective is index 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.cost.link import Link


class CommError(RuntimeError):
    """A collective failed: a peer never answered, or a peer disagreed about the call."""


class Scratch:
    """Work buffers kept from call to call, one per device and use (`key`), each grown to
    the largest request. Why: glibc hands large blocks back to the OS when freed, so a fresh work tensor
    costs a page fault per 4 KiB on first touch -- measured to halve the speed of a transfer
    into it. Only one collective of a communicator runs at a time, so keys cannot clash
    across calls; within a call, buffers alive at the same time need different keys."""

    def __init__(self):
        self._buffers: dict[tuple[torch.device, str], torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get((device, key))
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[(device, key)] = torch.empty(nbytes, dtype=torch.uint8,
                                                                device=device)
        return buffer[:nbytes].view(dtype)


@dataclass(eq=False)
class Wire:
    """Transfers of one collective call. `where` names the call in errors
    ("all_reduce on group dp (algorithm ring)"); `nodes[g]` is the node of group rank g."""

    group: dist.ProcessGroup
    where: str
    timeout_s: float
    nodes: list[int]
    rank: int  # this process's group rank
    scratch: Scratch
    device: torch.device  # the group's: every buffer of the call lives there
    tag: int = 0
    sent: int = 0
    recv: int = 0
    sent_inter_node: int = 0
    rounds: int = 0

    def post(self, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, torch.Tensor]]) -> list[tuple[dist.Work, str]]:
        """Start transfers (peers are group ranks); empty tensors are skipped on both sides,
        which agree because both derive sizes from the same call. Returns what to wait on."""
        ops, what = [], []
        for peer, t in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, group=self.group, tag=self.tag,
                                      group_peer=peer))
                what.append(f"a send of {t.numel() * t.element_size()} B to group rank {peer}")
                self.sent += t.numel() * t.element_size()
                if self.nodes[peer] != self.nodes[self.rank]:
                    self.sent_inter_node += t.numel() * t.element_size()
        for peer, t in recvs:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag,
                                      group_peer=peer))
                what.append(f"a message from group rank {peer}")
                self.recv += t.numel() * t.element_size()
        return list(zip(dist.batch_isend_irecv(ops), what)) if ops else []

    def wait(self, pending: list[tuple[dist.Work, str]]) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        for work, what in pending:
            try:
                work.wait(timeout)
            except RuntimeError as e:
                raise CommError(
                    f"{self.where}: group rank {self.rank} gave up on {what} after "
                    f"{self.timeout_s:g} s ({str(e).splitlines()[0]}). Every rank of the group "
                    "must make the same collective calls in the same order with the same sizes; "
                    "if a peer is only slow, raise comm.timeout_s") from None

    def exchange(self, sends: list[tuple[int, torch.Tensor]] = (),
                 recvs: list[tuple[int, torch.Tensor]] = ()) -> None:
        """One communication round: post everything, wait for everything."""
        self.wait(self.post(list(sends), list(recvs)))
        self.rounds += 1


@dataclass(frozen=True, eq=False)
class Team:
    """An ordered subset of the group: index i is group rank `members[i]`.
    `nodes[i]` is member i's node; `link` prices sub-phases for algorithms that choose them."""

    wire: Wire
    members: tuple[int, ...]
    index: int
    link: Link | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def nodes(self) -> list[int]:
        return [self.wire.nodes[g] for g in self.members]

    def sub(self, indices: list[int]) -> Team | None:
        """The team of the given indices (in that order); None if this member is not in it."""
        if self.index not in indices:
            return None
        return Team(self.wire, tuple(self.members[i] for i in indices),
                    indices.index(self.index), self.link)

    def rotated(self, root: int) -> Team:
        """The same members renumbered so that `root` is index 0 (rooted algorithms assume it)."""
        order = [(root + i) % self.size for i in range(self.size)]
        return self.sub(order)

    def exchange(self, sends: list[tuple[int, torch.Tensor]] = (),
                 recvs: list[tuple[int, torch.Tensor]] = ()) -> None:
        self.wire.exchange([(self.members[i], t) for i, t in sends],
                           [(self.members[i], t) for i, t in recvs])

    def post(self, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, torch.Tensor]]) -> list[tuple[dist.Work, str]]:
        return self.wire.post([(self.members[i], t) for i, t in sends],
                              [(self.members[i], t) for i, t in recvs])

    def wait(self, pending: list[tuple[dist.Work, str]]) -> None:
        self.wire.wait(pending)

    def scratch(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat work tensor for this call (see Scratch): contents undefined."""
        return self.wire.scratch.get(key, numel, dtype, self.wire.device)


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str,
                base: torch.Tensor | None = None) -> None:
    """dst <- dst (op) src, or base (op) src when `base` is given (one pass, no copy). avg is
    reduced as a sum (the caller divides once at the end). torch's CPU kernels compute
    bf16/fp16 arithmetic in fp32 and round once per call."""
    base = dst if base is None else base
    if op in ("sum", "avg"):
        torch.add(base, src, out=dst)
    elif op == "max":
        torch.maximum(base, src, out=dst)
    else:
        torch.minimum(base, src, out=dst)


def even_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of `parts` near-equal contiguous parts (the first numel % parts get one extra
    element): any element count works, parts may be empty."""
    base, extra = divmod(numel, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def part(x: torch.Tensor, bounds: list[int], i: int, j: int | None = None) -> torch.Tensor:
    """Parts i .. j-1 (default: part i) of flat `x` as one view."""
    return x[bounds[i]:bounds[i + 1 if j is None else j]]
