"""The machinery under every collective of one process group: the group's topology, the
choice of algorithm, the cross-rank agreement check, running the call on the lane (see
lane.py) and its entry in the ledger. Communicator (communicator.py) adds the collectives.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardtrain.cost import collectives as cost
from shardtrain.comm.dispatch import (ALGORITHMS, META, check_agreement, check_splits, choose,
                                      on_device)
from shardtrain.comm.lane import Handle, Lane, wait_native
from shardtrain.comm.ledger import CommLedger, CommRecord, native_volume
from shardtrain.comm.p2p import Scratch, Team, Wire

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
CHECKS = ("first", "all", "off")
PRICED = ("auto", "hierarchical")  # algorithms that price their choices with the link


class GroupRunner:
    """State and machinery shared by every collective of one group."""

    def __init__(self, group: dist.ProcessGroup | None, *, name: str, ranks: list[int],
                 ledger: CommLedger, node_size: int = 0, algorithm: str = "native",
                 timeout_s: float = 300.0, link: cost.Link | None = None,
                 check_sizes: str = "first", device: torch.device | str = "cpu",
                 meta: dist.ProcessGroup | None = None):
        """`ranks`: the group's global ranks; `node_size`: ranks per (virtual) node, nodes
        being runs of consecutive global ranks (0: one node); `link`: the alpha-beta-gamma
        figures `auto` and the hierarchical phases price with (None: this machine's
        calibration); `check_sizes`: compare sizes across ranks before the first call of
        each op ("first"), every call ("all") or never ("off"); `device`: where the group's
        payload lives; `meta`: the group the CPU metadata travels on (None: `group` itself,
        a Gloo group; beside an NCCL group, a Gloo group over the same ranks)."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"comm.algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        on_device(algorithm, torch.device(device), name)
        if check_sizes not in CHECKS:
            raise ValueError(f"check_sizes={check_sizes!r} is not one of {', '.join(CHECKS)}")
        self.group, self.name, self.ranks, self.ledger = group, name, list(ranks), ledger
        self.device, self.meta = torch.device(device), meta if meta is not None else group
        self.size = len(ranks)
        self.node_size = node_size or self.size
        self.nodes = [g // node_size for g in self.ranks] if node_size else [0] * self.size
        counts = {self.nodes.count(n) for n in self.nodes}
        self.local_size = self.nodes.count(self.nodes[0]) if len(counts) == 1 else 0
        self.algorithm, self.timeout_s, self.check_sizes = algorithm, timeout_s, check_sizes
        self.rank = self.ranks.index(dist.get_rank()) if group is not None else 0
        # Communicators sharing a process group (dp and dp_cp may both be WORLD) use their
        # own message tag, so their point-to-point messages never match each other's.
        self._tag = zlib.crc32(name.encode()) & 0x7FFF
        # NCCL: every wait is a stream wait and no lane thread runs (lane.py).
        self.streamed = group is not None and dist.get_backend(group) == "nccl"
        self._lane = Lane(name, threaded=not self.streamed)
        self._scratch = Scratch()
        self._checked: set[str] = set()
        self.link = link
        if self.size > 1 and algorithm in PRICED:
            self.link = self._agreed_link()

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank} of {self.size}, {self.algorithm})"

    def _choose(self, op: str, flat: torch.Tensor, requested: str | None, *,
                numel: int | None = None, equal_splits: bool = True) -> str:
        nbytes = (flat.numel() if numel is None else numel) * flat.element_size()
        if (requested or self.algorithm) in PRICED and self.link is None:
            self._no_link(requested or self.algorithm)
        name = choose(op, nbytes, requested=requested, default=self.algorithm, group=self.name,
                      p=self.size, local_size=self.local_size, link=self.link,
                      equal_splits=equal_splits)
        on_device(name, self.device, self.name)
        return name

    def _launch(self, op: str, name: str, record: CommRecord, *, async_op: bool, agree: dict,
                native: Callable[[], dist.Work], body: Callable[[Team], None],
                finish: Callable[[], None] | None, splits: tuple | None = None) -> Handle:
        """Run one call: on the lane (see lane.py), or -- a native async call on NCCL, or on
        Gloo with nothing queued and nothing to check -- issued at once. The agreement
        check, when due, is decided when the call runs, so every rank decides it at the same
        call. On NCCL `record.time_s` is host time (launch to the stream wait), not GPU time."""
        where = f"{op} on group {self.name} (algorithm {name})"
        started = time.perf_counter()

        def check() -> None:
            if self._check_due(op):  # metadata: over the CPU side channel
                check_agreement(self.meta, where, self.timeout_s, algorithm=name, **agree)
                if splits is not None:
                    check_splits(self.meta, where, self.timeout_s, *splits)

        def job() -> None:
            check()
            if name == "native":
                wait_native(native(), where, self.timeout_s, streamed=self.streamed)
            else:
                wire = Wire(self.group, where, self.timeout_s, self.nodes, self.rank,
                            self._scratch, self.device, self._tag)
                body(Team(wire, tuple(range(self.size)), self.rank, self.link))
                record.sent_bytes, record.recv_bytes = wire.sent, wire.recv
                record.sent_inter_node_bytes, record.rounds = wire.sent_inter_node, wire.rounds
            if finish is not None:
                finish()
            record.time_s = time.perf_counter() - started

        # Issued at once: on NCCL always (nothing is queued: no lane thread), on Gloo with
        # nothing queued before it and nothing to check.
        direct = name == "native" and async_op and not self._lane.busy()
        if direct and (self.streamed or not self._check_due(op, peek=True)):
            check()
            return Handle(work=native(), record=record, finish=finish, where=where,
                          timeout_s=self.timeout_s, streamed=self.streamed)
        handle = Handle(future=self._lane.run(job, async_op=async_op))
        if not async_op:
            handle.wait()
        return handle

    def _check_due(self, op: str, *, peek: bool = False) -> bool:
        due = self.check_sizes == "all" or (self.check_sizes == "first" and op not in self._checked)
        if not peek:
            self._checked.add(op)
        return due

    def _record(self, op: str, t: torch.Tensor, name: str, tag: str, *, root: int | None = None,
                numel: int | None = None) -> CommRecord:
        """The ledger entry; p2p algorithms overwrite the modelled volume with what they moved."""
        numel = t.numel() if numel is None else numel
        msg = numel * t.element_size()
        sent, recv, rounds = native_volume(op, msg, self.size, is_root=self.rank == root)
        record = CommRecord(op=op, group=self.name, algorithm=name,
                            dtype=str(t.dtype).removeprefix("torch."), numel=numel,
                            msg_bytes=msg, sent_bytes=sent, recv_bytes=recv, rounds=rounds,
                            tag=tag)
        self.ledger.add(record)
        return record

    def _no_link(self, algorithm: str) -> None:
        raise ValueError(f"algorithm {algorithm!r} on group {self.name} prices its choices "
                         "with a link, and none was given: pass link= when building the "
                         "communicator (cost.hardware.runtime_link)")

    def _agreed_link(self) -> cost.Link:
        """Rank 0's link, so that every rank's `auto` makes the same choices; native priced
        as this group's backend runs it."""
        if self.link is None:
            self._no_link(self.algorithm)
        figures = torch.tensor(self.link.figures(), dtype=torch.float64, device=META)
        dist.broadcast(figures, self.ranks[0], group=self.meta)
        gloo = dist.get_backend(self.group) == "gloo"  # else NCCL-style collectives
        return cost.Link.from_figures(figures.tolist(), "gloo" if gloo else "nccl")

    def _check_op(self, op: str) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} on group {self.name} is not one of "
                             f"{', '.join(REDUCE_OPS)}")

    def _average(self, t: torch.Tensor, op: str) -> Callable[[], None] | None:
        return (lambda: t.div_(self.size)) if op == "avg" else None

    def _expect(self, ok: bool, op: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{op} on group {self.name}: {why}")


def flat_view(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A flat contiguous view of t, or a contiguous copy and the step that writes it back."""
    if t.is_contiguous():
        return t.view(-1), None
    work = t.contiguous().view(-1)
    return work, lambda: t.copy_(work.view(t.shape))


def then(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    steps = [s for s in steps if s is not None]
    return (lambda: [s() for s in steps]) if steps else None
