"""Where a Communicator's calls run: the Lane, one per communicator, keeps its calls in
issue order on one thread (dispatch.py's module doc says why and when a call runs inline).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class Lane:
    """One communicator's calls in issue order (module doc); `threaded=False` (NCCL) runs
    every call inline."""

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
            # Unbound before the next get() blocks: the job's closure holds its tensors (a
            # ZeRO unit's flat gradient), which would otherwise live until the next call.
            del job, future
            with self._lock:
                self._queued -= 1


def _execute(job: Callable[[], None], future: Future) -> None:
    try:
        job()
    except BaseException as e:  # handed to whoever waits on the handle
        future.set_exception(e)
    else:
        future.set_result(None)
