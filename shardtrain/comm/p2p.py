"""Point-to-point plumbing under our algorithms: a Team per collective call (and per
algorithm phase), the element-wise reduction, and the index arithmetic of flat buffers.

A Team is an ordered subset of a communicator's group: index i is group rank `members[i]`,
which lets one algorithm run on a row of a torus, on the leaders of the nodes, or on a
team rotated so that the root of a rooted collective is index 0. It posts sends and
receives with `torch.distributed.batch_isend_irecv`, waits for them with the group's
timeout (Gloo: our algorithms run on CPU tensors only, see dispatch.py), and counts what
this rank puts on and takes off the wire in its `Traffic`: those counts are the ledger's
bytes, so the ledger reports what an algorithm really moved, not what a formula says.
Teams of one call share its Traffic and its work buffers.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.cost.link import Link


class CommError(RuntimeError):
    """A collective failed: a peer never answered, or a peer disagreed about the call."""


class CommTimeout(CommError):
    """A wait gave up: a peer never answered within comm.timeout_s (or its connection
    broke). Under the launcher the hang watchdog (comm/watchdog.py) takes it from here."""


@dataclass
class Traffic:
    """What this rank moved in one collective call: the ledger record's figures."""

    sent: int = 0
    recv: int = 0
    sent_inter_node: int = 0
    rounds: int = 0
    sent_to: dict[int, int] = dataclasses.field(default_factory=dict)  # group rank -> bytes


@dataclass(frozen=True, eq=False)
class Team:
    """An ordered subset of the group for one call. `where` names the call in errors
    ("all_reduce on group dp (algorithm ring)"); `node_of[g]` is the node of group rank g;
    `link` prices sub-phases for algorithms that choose them; `buffers` are the
    communicator's work buffers (see `scratch`)."""

    group: dist.ProcessGroup
    where: str
    timeout_s: float
    node_of: tuple[int, ...]
    members: tuple[int, ...]
    index: int
    buffers: dict
    device: torch.device  # the group's: every buffer of the call lives there
    tag: int = 0  # the communicator's message tag (groups may share a process group)
    link: Link | None = None
    traffic: Traffic = dataclasses.field(default_factory=Traffic)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def nodes(self) -> list[int]:
        """nodes[i]: member i's node."""
        return [self.node_of[g] for g in self.members]

    def sub(self, indices: list[int]) -> Team | None:
        """The team of the given indices (in that order); None if this member is not in it."""
        if self.index not in indices:
            return None
        return dataclasses.replace(self, members=tuple(self.members[i] for i in indices),
                                   index=indices.index(self.index))

    def rotated(self, root: int) -> Team:
        """The same members renumbered so that `root` is index 0 (rooted algorithms assume it)."""
        return self.sub([(root + i) % self.size for i in range(self.size)])

    def post(self, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, torch.Tensor]]) -> list[tuple[dist.Work, str]]:
        """Start transfers (peers are team indices); empty tensors are skipped on both sides,
        which agree because both derive sizes from the same call. Returns what to wait on."""
        ops, what, me = [], [], self.members[self.index]
        for i, t in sends:
            if t.numel():
                peer, nbytes = self.members[i], t.numel() * t.element_size()
                ops.append(dist.P2POp(dist.isend, t, group=self.group, tag=self.tag,
                                      group_peer=peer))
                what.append(f"a send of {nbytes} B to group rank {peer}")
                self.traffic.sent += nbytes
                self.traffic.sent_to[peer] = self.traffic.sent_to.get(peer, 0) + nbytes
                if self.node_of[peer] != self.node_of[me]:
                    self.traffic.sent_inter_node += nbytes
        for i, t in recvs:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag,
                                      group_peer=self.members[i]))
                what.append(f"a message from group rank {self.members[i]}")
                self.traffic.recv += t.numel() * t.element_size()
        return list(zip(dist.batch_isend_irecv(ops), what)) if ops else []

    def wait(self, pending: list[tuple[dist.Work, str]]) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        for work, what in pending:
            try:
                work.wait(timeout)
            except RuntimeError as e:
                raise CommTimeout(
                    f"{self.where}: group rank {self.members[self.index]} gave up on {what} "
                    f"after {self.timeout_s:g} s ({str(e).splitlines()[0]}). Every rank of the "
                    "group must make the same collective calls in the same order with the same "
                    "sizes; if a peer is only slow, raise comm.timeout_s") from None

    def exchange(self, sends: list[tuple[int, torch.Tensor]] = (),
                 recvs: list[tuple[int, torch.Tensor]] = ()) -> None:
        """One communication round: post everything, wait for everything."""
        self.wait(self.post(list(sends), list(recvs)))
        self.traffic.rounds += 1

    def scratch(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat work tensor on the group's device, contents undefined: see `scratch`."""
        return scratch(self.buffers, key, numel, dtype, self.device)


def wait_native(work: dist.Work, where: str, timeout_s: float, *, streamed: bool = False) -> None:
    """Wait for a backend call. `streamed` (NCCL): the current CUDA stream waits, the host
    does not; a peer that never answers is the process group's timeout (init_process_group
    and new_group get comm.timeout_s; the NCCL watchdog enforces it). Otherwise (Gloo) the
    host waits at most `timeout_s` and a CommError says why."""
    if streamed:
        work.wait()
        return
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise CommTimeout(f"{where}: no completion within comm.timeout_s={timeout_s:g} s "
                        f"({str(e).splitlines()[0]}). Every rank of the group must make the "
                        "same collective calls in the same order with the same sizes; if a "
                        "peer is only slow, raise comm.timeout_s") from None


def post_messages(group: dist.ProcessGroup, name: str, sends: list[tuple[int, torch.Tensor, str]],
                  recvs: list[tuple[int, torch.Tensor, str]]) -> list[tuple[dist.Work, str]]:
    """Post labelled point-to-point messages together (Communicator.exchange); each is
    (peer group rank, tensor, label). Returns what to wait on."""
    ops, what = [], []
    for peer, tensor, tag in sends:
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=peer,
                              tag=message_tag(tag)))
        what.append(f"send ({tag}) to group rank {peer} on group {name}")
    for peer, tensor, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, tensor, group=group, group_peer=peer,
                              tag=message_tag(tag)))
        what.append(f"recv ({tag}) from group rank {peer} on group {name}")
    return list(zip(dist.batch_isend_irecv(ops), what)) if ops else []


def scratch(buffers: dict, key: str, numel: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A work buffer kept from call to call, one per device and use (`key`), grown to the
    largest request. Why: glibc hands large blocks back to the OS when freed, so a fresh
    work tensor costs a page fault per 4 KiB on first touch -- measured to halve the speed
    of a transfer into it. Only one collective of a communicator runs at a time, so keys
    cannot clash across calls; within a call, buffers alive at the same time need
    different keys."""
    nbytes = numel * dtype.itemsize
    buffer = buffers.get((device, key))
    if buffer is None or buffer.numel() < nbytes:
        buffer = buffers[(device, key)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer[:nbytes].view(dtype)


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


def flat_view(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A flat contiguous view of t, or a contiguous copy and the step that writes it back."""
    if t.is_contiguous():
        return t.view(-1), None
    work = t.contiguous().view(-1)
    return work, lambda: t.copy_(work.view(t.shape))


def then(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    steps = [s for s in steps if s is not None]
    return (lambda: [s() for s in steps]) if steps else None


def rotate_into(dst: torch.Tensor, src: torch.Tensor, shift: int) -> None:
    """dst[(j + shift) % p] = src[j] for the p rows, without a temporary."""
    p = src.shape[0]
    shift %= p
    dst[shift:] = src[:p - shift]
    dst[:shift] = src[p - shift:]


def message_tag(tag: str) -> int:
    """The integer tag of a point-to-point message: from its label, kept apart (high bit)
    from the tags our collective algorithms use (a communicator's is its name's crc)."""
    return 0x8000 | (zlib.crc32(tag.encode()) & 0x7FFF)


def offsets(rows: list[int], row: int) -> list[int]:
    """Offsets of consecutive parts of `rows[i]` rows of `row` elements each."""
    out = [0]
    for r in rows:
        out.append(out[-1] + r * row)
    return out
