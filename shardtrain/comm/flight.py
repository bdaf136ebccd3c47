"""The flight recorder: each rank's last collectives, kept to say who hung when one never ends.

PyTorch's NCCL flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE; "Debugging hangs with the
flight recorder", PyTorch docs) keeps, per rank, a ring buffer of the last collectives with
a per-group sequence number, and dumps it when the watchdog sees a timeout: comparing the
ranks' sequence numbers for the hung group shows which ranks never entered the collective.
This module is that idea for every backend shardtrain runs on, at the Communicator level.

Each call of a Communicator (dispatch.run, barrier, send/recv/exchange) opens an `Entry`
when it starts running -- on the lane thread for a queued call, so that every rank of a
group numbers its collectives in the same order -- and closes it when its wait returns:
group, op, tag, sizes, algorithm, start time, state (issued, completed) and, for
collectives, the group's sequence number (1 for its first collective, 2 for the next...).
Point-to-point messages carry no sequence number (two ranks of a group exchange them, not
all): their entry names the peers instead. The recorder keeps the last `capacity` entries
(the ring, what a dump shows), every entry not yet completed (what a timeout examines),
and each group's sequence number (what a rank publishes, with the call it waits in:
comm/watchdog.py).

One recorder per process: it hangs off the ledger every communicator of a run shares.
On NCCL a call's wait is a stream wait that returns at once (dispatch.py), so an entry
with a backend work handle is completed only once the work reports it (`work.is_completed()`,
a query, never a wait): the watchdog polls it.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

CAPACITY = 64


@dataclass(slots=True, eq=False)
class Entry:
    group: str  # the communicator's name: dp, tp, pp, ...
    key: str  # the group across ranks: its name and first global rank ("dp@0")
    op: str
    seq: int  # the group's collective number; 0 for point-to-point messages
    ranks: tuple[int, ...]  # the group's global ranks
    peers: tuple[int, ...] = ()  # point-to-point: the global ranks at the other end
    tag: str = ""
    numel: int = 0
    nbytes: int = 0
    algorithm: str = "native"
    start: float = field(default_factory=time.monotonic)
    end: float = 0.0
    state: str = "issued"  # issued | completed
    streamed: bool = False  # NCCL: the host's wait was a stream wait (module doc)
    work: Any = None  # NCCL: the backend's work handle, queried by `poll`

    def describe(self) -> str:
        what = f"{self.op} #{self.seq}" if self.seq else f"{self.op} (point-to-point)"
        return (f"{what} on group {self.group} (ranks {_ranks(self.ranks)}; tag "
                f"{self.tag or '-'}; {self.numel} elements, {self.nbytes} B; algorithm "
                f"{self.algorithm})")


class FlightRecorder:
    """The last `capacity` calls of this process, its pending calls and each group's
    sequence number. Cheap by design (a few dict and deque operations per call, no lock:
    each group's calls are opened in one thread at a time, dispatch.py's issue order)."""

    def __init__(self, capacity: int = CAPACITY):
        self.ring: deque[Entry] = deque(maxlen=capacity)
        self.seqs: dict[str, int] = {}  # group key -> its last collective's number
        self.pending: dict[int, Entry] = {}  # id(entry) -> entry not completed

    def issue(self, comm, op: str, *, tag: str = "", numel: int = 0, nbytes: int = 0,
              algorithm: str = "native", peers: list[int] | None = None) -> Entry:
        """Open the entry of a call of `comm` (a Communicator) that starts now; `peers`:
        the group ranks at the other end of a point-to-point call."""
        key = group_key(comm.name, comm.ranks)
        seq = 0
        if peers is None:
            seq = self.seqs[key] = self.seqs.get(key, 0) + 1
        entry = Entry(group=comm.name, key=key, op=op, seq=seq, ranks=tuple(comm.ranks),
                      peers=tuple(comm.ranks[p] for p in peers or ()), tag=tag, numel=numel,
                      nbytes=nbytes, algorithm=algorithm,
                      streamed=getattr(comm, "streamed", False))
        self.ring.append(entry)
        self.pending[id(entry)] = entry
        return entry

    def complete(self, entry: Entry) -> None:
        """The call's wait returned. On NCCL (a stream wait) an entry with a work handle not
        yet finished stays pending until `poll` sees the work finish. On Gloo the host's
        wait is the answer: a Gloo work that failed (timed out) also reports completion to
        the query, and some never report it at all."""
        work = entry.work  # read once: the watchdog's `poll` may clear it meanwhile
        if entry.streamed and work is not None and not _finished(work):
            return
        entry.state, entry.end = "completed", time.monotonic()
        entry.work = None  # hold no backend object longer than needed
        self.pending.pop(id(entry), None)
        if len(self.pending) > 2 * CAPACITY:  # no watchdog polls (a direct use on NCCL):
            self.poll()  # finished works must not pile up with their tensors

    def poll(self) -> Entry | None:
        """Complete the pending entries whose work has finished; the oldest still pending."""
        oldest = None
        for entry in list(self.pending.values()):
            # Any backend: a work that says it finished well has (an async Gloo call may
            # finish long before the host waits for it). Read once: the thread that waits
            # for the call clears it when the wait returns (`complete`).
            work = entry.work
            if work is not None and _finished(work):
                entry.work = None
                self.complete(entry)
            elif oldest is None or entry.start < oldest.start:
                oldest = entry
        return oldest

    def snapshot(self) -> list[dict[str, Any]]:
        """The ring, oldest first, as JSON-ready dicts (start and end in Unix seconds)."""
        shift = time.time() - time.monotonic()
        out = []
        for e in list(self.ring):
            out.append({"group": e.group, "key": e.key, "op": e.op, "seq": e.seq,
                        "ranks": list(e.ranks), "peers": list(e.peers), "tag": e.tag,
                        "numel": e.numel, "bytes": e.nbytes, "algorithm": e.algorithm,
                        "state": e.state, "start": round(e.start + shift, 6),
                        "end": round(e.end + shift, 6) if e.end else None})
        return out

    def published(self, waiting: Entry | None = None) -> str:
        """What this rank publishes (watchdog.py): its sequence numbers, and the call it has
        been waiting in (`waiting`, if any), so a peer's diagnosis can follow a chain of
        waits to the rank that holds everyone up."""
        return json.dumps({"seqs": dict(self.seqs),
                           "waiting": waiting.describe() if waiting is not None else ""},
                          sort_keys=True)


def group_key(name: str, ranks: list[int] | tuple[int, ...]) -> str:
    """A group's name across ranks. The groups of one mesh dim partition the ranks, so the
    dim and the first rank tell them apart (the dp group of ranks 1, 3 is "dp@1")."""
    return f"{name}@{ranks[0]}"


def missing_ranks(entry: Entry, seqs: dict[int, dict[str, int] | None]) -> list[int]:
    """The ranks of `entry`'s group that have not entered it: those whose published
    sequence number for the group is below the entry's (a rank that published nothing counts
    as 0). `seqs`: global rank -> its published numbers (None: never published). A
    point-to-point entry's answer is its peers: which side stalls is not recorded."""
    if not entry.seq:
        return list(entry.peers)
    return [r for r in entry.ranks if number(seqs.get(r), entry.key) < entry.seq]


def number(seqs: dict[str, int] | None, key: str) -> int:
    """A rank's sequence number for group `key` (0: none published)."""
    return (seqs or {}).get(key, 0)


def _finished(work) -> bool:
    """A backend work finished without error (a query: never waits).

    Read through the work's future: `Work.exception()` is deprecated (torch prints a warning
    once per process) and `get_future_result` is not implemented on Gloo. A failed work's
    future is done and raises from `value()` (a Gloo timeout among them, which also reports
    completion to `is_completed`). A work with no future (Gloo's point-to-point) is never
    called finished here: its entry completes when the host's wait returns (`complete`),
    and a failure raises there, so a failed message never passes for a completed one."""
    if not work.is_completed():
        return False
    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return False
    if not future.done():
        return False
    try:
        future.value()
    except Exception:  # the work failed; its error is raised again by the host's wait
        return False
    return True


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
