"""The executor's time marks (executor.py's timeline): perf_counter on CPU, CUDA events on
a GPU."""

from __future__ import annotations

import time

import torch


class Clock:
    """Time marks of one run: perf_counter on CPU; CUDA events on a GPU, resolved to seconds
    from `origin` (a mark of an earlier run; None: this run's first mark) by `seconds`."""

    def __init__(self, device: torch.device, origin: float | torch.cuda.Event | None = None):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.origin = origin

    @staticmethod
    def stamp(cuda: bool) -> float | torch.cuda.Event:
        """Now: perf_counter's seconds, or an event recorded on the current stream."""
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> int:
        self.marks.append(self.stamp(self.cuda))
        if self.origin is None:
            self.origin = self.marks[0]
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        """Each mark's time from the origin. On CUDA the last mark must have passed
        (`PipelineExecutor.settle`): waiting for it is the step's own agreed decision's."""
        if not self.cuda:
            return [t - self.origin for t in self.marks]
        self.marks[-1].synchronize()  # passed already: STEP_SYNCS (train/syncs.py)
        return [self.origin.elapsed_time(e) / 1e3 for e in self.marks]
