"""The planner's unit of traffic: one kind of transfer a rank takes part in during a step
(`CommOp`), priced by the cost model for where its group's ranks sit (`Placement`), and the
sums over a step (`bytes_per_step`). plan/traffic.py and plan/tensor_traffic.py build them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtrain.cost.collectives import best_algorithm, cost
from shardtrain.cost.hardware import Hardware
from shardtrain.cost.link import Link


@dataclass(frozen=True, kw_only=True)
class CommOp:
    group: str
    op: str  # a cost-model collective, or send_recv (point-to-point)
    ranks: int
    message_bytes: float  # one call, in the cost model's convention
    calls: int  # per step
    algorithm: str
    bytes_sent: float  # per rank per step
    time_s: float  # per step, all calls, as if nothing overlapped
    overlap: str  # hides under: "step" the last backward, "backward" every backward,
    # "compute" all compute; "none": exposed
    what: str = ""  # which of a group's same-op transfers (ep: counts, dispatch, combine)

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "op": self.op, "what": self.what, "ranks": self.ranks,
                "message_bytes": self.message_bytes, "calls": self.calls,
                "algorithm": self.algorithm, "bytes_sent": self.bytes_sent,
                "time_s": self.time_s, "overlap": self.overlap}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a group's ranks sit: `link` is what a flat algorithm crosses; a group with
    `local` (> 1) members per node and more outside can also run two-tier algorithms."""

    link: Link
    intra: Link | None = None
    local: int = 0


def placement(hw: Hardware, node: int, stride: int, size: int) -> Placement:
    """A group of `size` ranks `stride` apart on nodes of `node` ranks."""
    local = max(1, min(size, node // stride)) if stride < node else 1
    if local == size:
        return Placement(link=hw.intra_link())
    if local == 1:
        return Placement(link=hw.inter_link())
    return Placement(link=hw.inter_link(), intra=hw.intra_link(), local=local)


def collective(group: str, op: str, size: int, nbytes: float, calls: int, where: Placement,
                overlap: str) -> CommOp:
    algorithm = best_algorithm(op, nbytes, size, where.link, intra=where.intra,
                               local_size=where.local)
    one = cost(op, nbytes, size, where.link, algorithm=algorithm, intra=where.intra,
               local_size=where.local)
    return CommOp(group=group, op=op, ranks=size, message_bytes=nbytes, calls=calls,
                  algorithm=algorithm, bytes_sent=one.sent_bytes * calls,
                  time_s=one.time_s * calls, overlap=overlap)


def p2p(group: str, size: int, nbytes: float, calls: int, link: Link, overlap: str) -> CommOp:
    return CommOp(group=group, op="send_recv", ranks=size, message_bytes=nbytes, calls=calls,
                  algorithm="p2p", bytes_sent=nbytes * calls,
                  time_s=calls * (link.alpha_s + nbytes * link.beta_s_per_byte), overlap=overlap)


FREE = Placement(link=Link(alpha_s=0.0, beta_s_per_byte=0.0))  # bytes only, no time


def a2a(size: int, nbytes: float, calls: int, where: Placement, group: str = "cp",
         what: str = "", op: str = "all_to_all") -> CommOp:
    """`op` (all-to-all: pairwise, (n-1)/n of the input) as the runtime's native backend
    runs it and the ledger counts it."""
    one = cost(op, nbytes, size, where.link, algorithm="native")
    return CommOp(group=group, op=op, ranks=size, message_bytes=nbytes, calls=calls,
                  algorithm="native", bytes_sent=one.sent_bytes * calls,
                  time_s=one.time_s * calls, overlap="none", what=what)


def bytes_per_step(ops: list[CommOp]) -> dict[str, dict[str, float]]:
    """{group: {op: bytes sent per rank per step}}."""
    out: dict[str, dict[str, float]] = {}
    for op in ops:
        out.setdefault(op.group, {}).setdefault(op.op, 0.0)
        out[op.group][op.op] += op.bytes_sent
    return out
