"""Step records read on logged steps only: a step's device values wait on the device.

A step's record (metrics.jsonl, `TrainResult.history`) needs values the device computes --
the loss, the gradient norm, the mixture-of-experts totals -- and its duration. Reading
them every step would make the host wait for the device every step (on a GPU, the launch
queue drains and the next step's kernels start late). So the step leaves them here
(`PendingRecords.add`): its device values stacked into one tensor, its start and end marks
(`StepTimer`). On a logged step (train.log_every, the last, an eval, a bad step, a
checkpoint: `Trainer.run`) `flush` reads every step waiting, in one transfer, and fills in
their records in place -- the same fields, per step, as if each had been read at once.
train/syncs.py lists this read, with the step's one other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class StepTimer:
    """A step's start and end: perf_counter on CPU; on a GPU events recorded on the current
    stream, so the duration is the device's, read once the device has passed them."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark: float | torch.cuda.Event) -> None:
        """Until the device has passed `mark` (on CPU it has)."""
        if self.cuda:
            mark.synchronize()  # STEP_SYNCS: the logged step's read

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class Pending:
    record: dict[str, Any]  # filled in by `finish` at the flush
    values: torch.Tensor  # [k] fp32: the step's device values, in `finish`'s order
    start: Any  # StepTimer marks
    end: Any
    finish: Callable[[dict[str, Any], list[float], float], None]  # (record, values, seconds)


class PendingRecords:
    """The steps whose records are not read yet, oldest first."""

    def __init__(self, timer: StepTimer):
        self.timer = timer
        self.steps: list[Pending] = []

    def add(self, record: dict[str, Any], values: list[torch.Tensor], start: Any, end: Any,
            finish: Callable[[dict[str, Any], list[float], float], None]) -> None:
        """`values`: tensors on the step's device (a parameter server's norm may be a host
        tensor: it joins the loss's device), kept unread."""
        device = values[0].device
        flat = torch.cat([v.detach().reshape(-1).to(device=device, dtype=torch.float32)
                          for v in values])  # [k]
        self.steps.append(Pending(record, flat, start, end, finish))

    def flush(self) -> list[dict[str, Any]]:
        """Read every waiting step's values in one transfer and fill in their records
        (oldest first); returns those records."""
        if not self.steps:
            return []
        steps, self.steps = self.steps, []
        self.timer.wait(steps[-1].end)
        values = torch.cat([p.values for p in steps]).tolist()  # STEP_SYNCS: logged steps
        at = 0
        for p in steps:
            n = p.values.numel()
            p.finish(p.record, values[at:at + n], self.timer.seconds(p.start, p.end))
            at += n
        return [p.record for p in steps]
