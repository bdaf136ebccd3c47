"""The attention compute time of one rank, summed over intervals, without a host sync.

On CPU each interval is timed with perf_counter. On CUDA each interval is a pair of events
recorded on the current stream; they are resolved to seconds only when `seconds` is read
(which waits for the last event), so timing never blocks the host inside a step (as the
pipeline executor's Clock does).
"""

from __future__ import annotations

import time

import torch


class ComputeTimer:
    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._done = 0.0  # seconds of resolved intervals
        self._pairs: list = []  # CUDA (start, end) events not yet resolved
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError("ComputeTimer.stop() without start()")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._start, end))
        else:
            self._done += time.perf_counter() - self._start
        self._start = None

    @property
    def seconds(self) -> float:
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self._done += sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
            self._pairs.clear()
        return self._done


class NoTimer:
    """A timer that keeps nothing (the single-process simulation)."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass
