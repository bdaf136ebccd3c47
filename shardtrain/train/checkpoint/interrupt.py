"""Graceful interrupt and preemption: SIGINT (Ctrl-C) and SIGTERM (what cluster schedulers
send before they take the machine back) stop training at a step boundary, with a checkpoint.

The handler only records the signal: the training loop asks `stop_after(step)` once per
completed step. On one process the answer is immediate. On several, the ranks must stop
after the *same* step (a rank that stops early leaves its peers blocked in the next step's
collectives), and they see the signal at different moments, or not at all (a `kill` of
the launcher reaches the workers through it). So a rank that saw a signal proposes, at the
end of its step s, to stop after step s + LAG (2) through the job's key-value store (the
first proposal wins: compare-and-set). The store, not a collective, carries it, so the
communication ledger of a step is unchanged.

No step waits for the store: every rank reads the key on a thread of its own, started at
the end of each step, and takes the answer at the end of the next (a step later it has
long arrived; the step never waits on a round-trip to the store, which one server answers
for every rank of the job). Why that read sees a proposal in time: a rank finishing step
s + 1 needed the proposer in that step's collectives, and the proposer proposed before
starting it, so the read started then sees the proposal, and is taken at the end of step
s + 2 = s + LAG, the step every rank stops after. (Stopping after s + 1 would need a read
the end of step s + 1 waits for: a round-trip per step, on every rank.)

A second signal aborts at once (exit 128 + signal number, no checkpoint). A signal that
comes within `DUPLICATE_S` of the first is the same interrupt delivered twice, not a
second one: Ctrl-C reaches every process of the terminal's process group, and the
launcher (torch's elastic agent) forwards the signal it got to its workers as well.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist

KEY = "shardtrain/interrupt/stop_after"
LAG = 2  # steps from the proposal to the stop (module doc)
DUPLICATE_S = 1.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 130 (SIGINT), 143 (SIGTERM)."""
    return 128 + signum


EXIT_CODES = {exit_code(s) for s in SIGNALS}


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupt:
    """Installed in a training process's main thread for the length of a run."""

    def __init__(self, world_size: int, *, catch: bool = True):
        """`catch` False: the signals keep their default action (fault.mode=replicas: a
        group being torn down must go at once, launch_replicas.py GROUP_SHUTDOWN_S)."""
        self.world_size, self._catch = world_size, catch
        self.signum = 0  # the first signal received (0: none)
        self._first_at = 0.0
        self._proposed = False
        self._stop_after: int | None = None
        self._read: _Read | None = None  # the store read started at the last step's end
        self._previous = {}

    def __enter__(self) -> "Interrupt":
        if not self._catch or threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: nothing to catch
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < DUPLICATE_S:
            return  # the same interrupt, delivered by the terminal and the launcher
        print(f"second {signal_name(signum)}: aborting without a checkpoint",
              file=sys.stderr, flush=True)
        os._exit(exit_code(signum))

    def stop_after(self, step: int) -> bool:
        """At the end of completed step `step` (every rank calls this at every step):
        whether every rank stops now. On several ranks the job's store says, read a step
        ahead on a thread (module doc)."""
        if self.world_size == 1:
            return bool(self.signum)
        store = dist.distributed_c10d._get_default_store()
        if self.signum and not self._proposed and self._stop_after is None:
            self._proposed = True  # once: the first proposal stays, and this tells which
            self._learn(store.compare_set(KEY, "", f"{step + LAG}:{self.signum}"))
        if self._stop_after is None:
            if self._read is not None:
                self._learn(self._read.result())
            self._read = _Read(store) if self._stop_after is None else None
        return self._stop_after is not None and step >= self._stop_after

    def _learn(self, value: bytes | None) -> None:
        if value:
            stop_after, signum = value.decode().split(":")
            self._stop_after = int(stop_after)
            self.signum = self.signum or int(signum)  # it may have reached another rank only

    def describe(self, step: int, checkpoint: str) -> str:
        """The one line rank 0 prints: what stopped the run, where it saved, how to resume."""
        return (f"{signal_name(self.signum)}: stopped after step {step}, checkpoint "
                f"{checkpoint}; resume with the same command and --checkpoint.resume latest")


class _Read:
    """One read of the proposal (None: none yet) on a thread of its own."""

    def __init__(self, store):
        self.value: bytes | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(store,), daemon=True,
                                       name="shardtrain-interrupt")
        self.thread.start()

    def _run(self, store) -> None:
        try:
            self.value = store.get(KEY) if store.check([KEY]) else None
        except Exception as e:  # raised on the training thread, as a direct read's would be
            self.error = e

    def result(self) -> bytes | None:
        self.thread.join()  # started a step ago: done long since
        if self.error is not None:
            raise self.error
        return self.value
