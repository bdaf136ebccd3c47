"""The hang watchdog: when a collective times out, every rank exits, each naming the group,
the op, its sequence number and the ranks that never arrived.

A hung collective is seen only by the ranks that entered it (Gloo raises after
comm.timeout_s); the rank that never arrived -- asleep, stuck in compute, dead -- sees
nothing, and those that did cannot ask it, since asking would be another collective. So
the ranks talk through the c10d store (the TCPStore torch.distributed was initialised with:
torchrun's agent's, or rank 0's), which needs no collective:

- every rank publishes its per-group sequence numbers (comm/flight.py) under
  `shardtrain/flight/<attempt>/seq/<rank>`. Not on every call: the store is one server
  for the whole job, which a write per collective per rank would load with thousands of
  ranks times thousands of calls a second (figures in docs/faults.md). This watchdog thread
  publishes them once per `interval` (1 s, or a quarter of comm.timeout_s if that is
  shorter), when they changed, with the call it has waited in for a full interval, if any.
  A rank blocked in a collective for comm.timeout_s has published that collective's number
  long before anyone reads it; a rank that never entered it has published an older one.
- the first rank to give up (its wait raised, or its oldest pending call outlived
  comm.timeout_s: on NCCL, where waits do not block the host, the work is polled, never
  waited) reads its peers' numbers: the ranks below its own for that group never arrived
  (`flight.missing_ranks`). It writes that diagnosis under `.../abort`.
- every watchdog polls that key each `interval`: a rank that sees it (however it is stuck)
  adds its own view, and every rank dumps its ring to `<run_dir>/flight/rank<R>.json`,
  prints the diagnosis on stderr, counts itself under `.../acks`, waits up
  to `linger` s for every rank to do the same (so that no launcher kills a peer before it
  could speak, and the store's host stays up), and ends the process with os._exit(1): a
  rank stuck in a backend call cannot unwind, and NCCL's own watchdog tears the process
  down the same way. Exit within comm.timeout_s + interval + linger.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from shardtrain.comm.flight import Entry, FlightRecorder, missing_ranks, number
from shardtrain.comm.threads import device_thread

PREFIX = "shardtrain/flight/"
EXIT_CODE = 1
# NCCL process groups get comm.timeout_s + this as their own timeout (shardtrain.launch), so
# this watchdog, at comm.timeout_s, names the missing ranks before NCCL's tears the process
# down (TORCH_NCCL_ASYNC_ERROR_HANDLING); NCCL's remains the backstop.
NCCL_GRACE_S = 15.0


class Watchdog:
    """One per process (shardtrain.launch starts it after the mesh is built)."""

    def __init__(self, recorder: FlightRecorder, store, *, rank: int, world_size: int,
                 timeout_s: float, run_dir: str | Path, interval: float = 1.0,
                 linger: float = 5.0, attempt: int = 0):
        """`attempt`: the launcher's restart count, which keeps each attempt's keys apart
        (a restarted job must not read the last attempt's report)."""
        self.recorder, self.store, self.rank, self.world_size = recorder, store, rank, world_size
        self.prefix = f"{PREFIX}{attempt}/"
        self.timeout_s, self.interval, self.linger = timeout_s, interval, linger
        self.path = Path(run_dir) / "flight" / f"rank{rank}.json"
        self._stop = threading.Event()
        self._aborting = threading.Lock()
        self._published = ""
        # Polling an NCCL work reaches the rank's GPU: the thread runs with it current, the
        # one current here (comm/threads.py).
        self._thread = device_thread(self._loop, name="shardtrain-watchdog")

    def start(self) -> Watchdog:
        self.publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)

    # ------------------------------------------------------------------ every interval

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            oldest = self.recorder.poll()
            try:
                self.publish(oldest)
                reported = self.store.check([self.prefix + "abort"])
            except Exception:  # the store's host is gone: the run is ending anyway
                continue
            if reported:
                self.abort(None)
            elif oldest is not None and time.monotonic() - oldest.start > self.timeout_s:
                self.abort(f"the call has lasted over comm.timeout_s={self.timeout_s:g} s")

    def publish(self, oldest: Entry | None = None) -> None:
        """Write this rank's numbers and, once it has waited a full interval in one call,
        that call (flight.FlightRecorder.published), if they changed."""
        if oldest is not None and time.monotonic() - oldest.start < self.interval:
            oldest = None
        text = self.recorder.published(oldest)
        if text != self._published:
            self.store.set(f"{self.prefix}seq/{self.rank}", text)
            self._published = text

    def peer_states(self, ranks: tuple[int, ...]) -> dict[int, dict]:
        """Each rank's published state ({"seqs": ..., "waiting": ...}; {} if it never
        published); this rank's own sequence numbers are its current ones."""
        out: dict[int, dict] = {}
        for r in ranks:
            key = f"{self.prefix}seq/{r}"
            if r == self.rank:
                out[r] = {"seqs": dict(self.recorder.seqs), "waiting": ""}
            else:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else {}
        return out

    # ------------------------------------------------------------------ the way out

    def diagnose(self, entry: Entry, why: str) -> str:
        """One line: the stuck call, the ranks that never arrived and their numbers."""
        states = self.peer_states(entry.ranks)
        seqs = {r: state.get("seqs") for r, state in states.items()}
        missing = [r for r in missing_ranks(entry, seqs) if r != self.rank]
        numbers = ", ".join(
            f"rank {r}: #{number(seqs[r], entry.key)}" + (
                f", waiting in {states[r]['waiting']}" if states[r].get("waiting") else "")
            for r in missing)
        who = (f"ranks that did not arrive: {missing} (their last {entry.group} collective: "
               f"{numbers})" if entry.seq else f"peers that did not answer: {missing}")
        if not missing:
            who = "every rank of the group entered it (a peer is slow, or waits elsewhere)"
        age = time.monotonic() - entry.start
        return (f"rank {self.rank}: collective timed out: {entry.describe()}, started "
                f"{age:.1f} s ago; {who} (rank {self.rank}'s wait: {why})")

    def abort(self, why: str | None) -> None:
        """Diagnose, dump, tell the peers, end the process; never returns. `why`: this
        rank's own reason (its wait failed: the error's text); None: a peer reported."""
        if not self._aborting.acquire(blocking=False):
            threading.Event().wait()  # another thread of this process is on its way out
        lines = []
        try:
            entry = self.recorder.poll()
            self.publish(entry)
            if why is not None and entry is not None:
                lines.append(self.diagnose(entry, why))
                if not self.store.check([self.prefix + "abort"]):
                    self.store.set(self.prefix + "abort", lines[0])
            report = self.store.get(self.prefix + "abort").decode() \
                if not lines and self.store.check([self.prefix + "abort"]) else ""
            if report:
                mine = f"this rank's oldest pending call: {entry.describe()}" if entry else \
                    "this rank had no collective pending"
                lines.append(f"rank {self.rank}: exiting because a peer reported a hang: "
                             f"[{report}]; {mine}")
        except Exception as e:  # the store may be gone: say what is known
            lines.append(f"rank {self.rank}: hang diagnosis incomplete ({e}); "
                         f"reason: {why or 'a peer reported a timeout'}")
        if not lines:
            lines.append(f"rank {self.rank}: exiting: {why}")
        self._dump(lines)
        print("\n".join(f"[shardtrain flight] {line}" for line in lines)
              + f"\n[shardtrain flight] rank {self.rank}: last collectives in {self.path}",
              file=sys.stderr, flush=True)
        self._linger()
        os._exit(EXIT_CODE)

    def _dump(self, lines: list[str]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"rank": self.rank, "diagnosis": lines,
                                             "seqs": dict(self.recorder.seqs),
                                             "entries": self.recorder.snapshot()}, indent=1))
        except OSError as e:
            print(f"[shardtrain flight] rank {self.rank}: could not write {self.path}: {e}",
                  file=sys.stderr, flush=True)

    def _linger(self) -> None:
        deadline = time.monotonic() + self.linger
        try:
            acks = self.store.add(self.prefix + "acks", 1)
            while acks < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
                acks = self.store.add(self.prefix + "acks", 0)
            if self.rank == 0:  # the store's host under a plain env:// start: leave last
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        except Exception:
            pass
