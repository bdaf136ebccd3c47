"""Where a communicator's collectives run, and the handle a caller waits on.

A Lane runs one communicator's collectives in the order they were issued. On Gloo, whose
waits block the calling thread until the transfer is done, a synchronous
call with nothing queued runs right away on the caller's thread (no hand-off cost for small
messages); an asynchronous call, or any call issued while earlier ones are still queued, runs
on the lane's own thread, so DP's bucket all-reduces proceed while backward computes (torch
releases the GIL inside tensor ops and inside waits). Calls made from inside a running job
(a compressed all-reduce calling all_to_all) run inline. One thread drives a communicator.
On NCCL the lane runs every call inline and starts no thread: a call only enqueues work on
the GPU, and its wait (`wait_native` with `streamed`) makes the current CUDA stream, not the
host, wait for it, so the host runs ahead and the transfers overlap compute by themselves.

Order matters twice: peers match point-to-point messages in posting order, and Gloo matches
native collectives in issue order; queueing every call of a group behind the earlier ones
keeps both orders identical on every rank.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch.distributed as dist

from shardtrain.comm.ledger import CommRecord
from shardtrain.comm.p2p import CommError


class Lane:
    def __init__(self, name: str, *, threaded: bool = True):
        self.name, self.threaded = name, threaded
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._queued = 0

    def busy(self) -> bool:
        with self._lock:
            return self._queued > 0

    def run(self, job: Callable[[], None], *, async_op: bool) -> Future:
        future: Future = Future()
        inline = not self.threaded or threading.current_thread() is self._thread
        if inline or not (async_op or self.busy()):
            _execute(job, future)
            return future
        with self._lock:
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"comm-{self.name}",
                                                daemon=True)
                self._thread.start()
        self._jobs.put((job, future))
        return future

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            _execute(job, future)
            with self._lock:
                self._queued -= 1


def _execute(job: Callable[[], None], future: Future) -> None:
    try:
        job()
    except BaseException as e:  # handed to whoever waits on the handle
        future.set_exception(e)
    else:
        future.set_result(None)


class Handle:
    """A launched collective: `wait()` blocks until it is done (and raises its error).

    Either a running lane job (`future`), or a native collective issued directly (`work`),
    whose finishing step -- the division of an average, a copy back into a non-contiguous
    tensor -- and ledger time stamp happen on wait."""

    def __init__(self, *, future: Future | None = None, work: dist.Work | None = None,
                 record: CommRecord | None = None, finish: Callable[[], None] | None = None,
                 where: str = "", timeout_s: float = 300.0, streamed: bool = False):
        self._future, self._work, self._record, self._finish = future, work, record, finish
        self._where, self._timeout_s, self._streamed = where, timeout_s, streamed
        self._start = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        if self._future is not None:
            self._future.result()
            return
        if self._work is not None:
            wait_native(self._work, self._where, self._timeout_s, streamed=self._streamed)
        if self._finish is not None:
            self._finish()
        if self._record is not None:
            self._record.time_s = time.perf_counter() - self._start


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
        raise CommError(f"{where}: no completion within comm.timeout_s={timeout_s:g} s "
                        f"({str(e).splitlines()[0]}). Every rank of the group must make the "
                        "same collective calls in the same order with the same sizes; if a "
                        "peer is only slow, raise comm.timeout_s") from None
