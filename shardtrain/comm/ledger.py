"""The communication ledger: one record per collective call, per rank.

Bytes are what this rank puts on (sent) and takes off (recv) the wire. Our point-to-point
algorithms count them message by message (comm/p2p.py). For the native backend they follow
the algorithm the backend is modelled as (see `native_volume`):
ring for all-reduce / all-gather / reduce-scatter (NCCL and Gloo both use ring-style
algorithms for large messages), pairwise exchange for all-to-all, and direct root <-> peer
transfers for the rooted ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtrain.comm.flight import FlightRecorder


@dataclass(kw_only=True, slots=True)
class CommRecord:
    op: str
    group: str  # the mesh dim that owns the group: dp, tp, pp, ...
    algorithm: str
    dtype: str
    numel: int  # elements of the message (the full tensor; for all_gather the output)
    msg_bytes: int
    sent_bytes: int
    recv_bytes: int
    rounds: int  # communication steps (our algorithms: the steps this rank took part in)
    tag: str = ""  # what the bytes are for: "grad", "metric", ...
    time_s: float = 0.0  # launch to completion (async ops: includes overlapped compute)
    # Bytes this rank sent to ranks on other nodes: counted by our point-to-point algorithms;
    # None for the native backend, whose routing is not visible.
    sent_inter_node_bytes: int | None = None
    # Bytes this rank sent to each group rank: the load on each of its outgoing links (our
    # point-to-point algorithms; None for the native backend).
    sent_to: dict[int, int] | None = None


@dataclass
class CommLedger:
    """The records of this rank's calls. The trainer closes an interval (`mark`) every step;
    once more than 2 x `keep` records are held, those of closed intervals beyond the newest
    `keep` are dropped, so a long run's ledger stays bounded (per-step totals live on in
    metrics.jsonl). The open interval is never trimmed. `flight`: the flight recorder of
    the same calls (the last few, with their state and sequence numbers: comm/flight.py),
    shared the same way."""

    records: list[CommRecord] = field(default_factory=list)
    keep: int = 10_000
    flight: FlightRecorder = field(default_factory=FlightRecorder)
    _mark: int = 0

    def add(self, record: CommRecord) -> None:
        self.records.append(record)
        if len(self.records) >= 2 * self.keep:
            drop = min(len(self.records) - self.keep, self._mark)
            del self.records[:drop]
            self._mark -= drop

    def since_mark(self) -> list[CommRecord]:
        return self.records[self._mark:]

    def mark(self) -> list[CommRecord]:
        """Close the current interval (an optimizer step) and return its records."""
        out = self.since_mark()
        self._mark = len(self.records)
        return out

    @staticmethod
    def totals(records: list[CommRecord]) -> dict[str, float]:
        return {"calls": len(records),
                "sent_bytes": sum(r.sent_bytes for r in records),
                "recv_bytes": sum(r.recv_bytes for r in records),
                "time_s": sum(r.time_s for r in records)}


def add_record(ledger: CommLedger, *, op: str, group: str, algorithm: str, dtype: str, numel: int,
           msg_bytes: int, p: int, is_root: bool, tag: str) -> CommRecord:
    """Add the record of one call, with the native backend's modelled volume (our
    point-to-point algorithms overwrite it with what they moved)."""
    sent, recv, rounds = native_volume(op, msg_bytes, p, is_root=is_root)
    entry = CommRecord(op=op, group=group, algorithm=algorithm, dtype=dtype, numel=numel,
                       msg_bytes=msg_bytes, sent_bytes=sent, recv_bytes=recv, rounds=rounds,
                       tag=tag)
    ledger.add(entry)
    return entry


def native_volume(op: str, msg_bytes: int, p: int, *, is_root: bool) -> tuple[int, int, int]:
    """(sent, recv, rounds) for one rank under the native backend's modelled algorithm.

    all_reduce: ring, 2(p-1)/p S each way in 2(p-1) rounds; all_gather / reduce_scatter:
    ring, (p-1)/p S (S the full gathered size); all_to_all: pairwise, (p-1)/p S;
    broadcast / scatter: the root sends each peer its part directly; gather / reduce: each
    peer sends to the root directly; send / recv: S one way.
    """
    if p == 1:
        return 0, 0, 0
    ring = (p - 1) * msg_bytes // p
    if op == "all_reduce":
        return 2 * ring, 2 * ring, 2 * (p - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return ring, ring, p - 1
    if op == "broadcast":
        return ((p - 1) * msg_bytes, 0, p - 1) if is_root else (0, msg_bytes, 1)
    if op == "scatter":
        return (ring, 0, p - 1) if is_root else (0, msg_bytes // p, 1)
    if op == "reduce":
        return (0, (p - 1) * msg_bytes, p - 1) if is_root else (msg_bytes, 0, 1)
    if op == "gather":
        return (0, ring, p - 1) if is_root else (msg_bytes // p, 0, 1)
    if op == "send":
        return msg_bytes, 0, 1
    if op == "recv":
        return 0, msg_bytes, 1
    if op == "barrier":
        return 0, 0, 1
    raise ValueError(f"unknown collective {op!r}")
