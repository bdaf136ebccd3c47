"""Profiling a run: a torch.profiler trace of chosen steps, and CUDA memory snapshots.

`train.profile_steps = "A:B"` records steps A to B (inclusive, metrics.jsonl's numbering)
with torch.profiler: CPU activity, and CUDA kernels on a GPU. Each step is one
`record_function` range named "step N", so the trace shows where every step begins and
ends. Each rank writes <run_dir>/profile/trace_rank{R}.json, a Chrome trace that Perfetto
(ui.perfetto.dev) and chrome://tracing open.

`train.memory_snapshot = true` on CUDA records the caching allocator's history (every
allocation with its stack) from the first step, and dumps it to
<run_dir>/profile/memory_snapshot_rank{R}.pickle at the end of the run, or at the step that
ran out of memory (then the error goes on); https://pytorch.org/memory_viz draws it. A CPU
has no caching allocator to record: the option is skipped there, with a one-line reason.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from shardtrain.config.observe import profile_range

SNAPSHOT_ENTRIES = 100_000  # allocator events kept (a ring buffer)


class StepProfiler:
    def __init__(self, train, rank: int, device: torch.device):
        """train: the TrainConfig (profile_steps, memory_snapshot, run_dir)."""
        self.steps = profile_range(train.profile_steps)
        self.dir = Path(train.run_dir) / "profile"
        self.rank, self.device = rank, device
        self.prof: torch.profiler.profile | None = None
        self.snapshot = train.memory_snapshot and device.type == "cuda"
        if train.memory_snapshot and not self.snapshot and rank == 0:
            print(f"train.memory_snapshot: skipped on {device.type} (it records the CUDA "
                  "caching allocator, which only a GPU run has)", file=sys.stderr)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Around optimizer step `n`: starts the trace at A, writes it after B."""
        if self.steps is not None and n == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        try:
            if self.prof is None:
                yield
            else:
                with torch.profiler.record_function(f"step {n}"):
                    yield
        except torch.OutOfMemoryError:
            self.dump_snapshot()
            raise
        if self.prof is not None and n == self.steps[1]:
            self.write_trace()

    def write_trace(self) -> None:
        self.prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.dir / f"trace_rank{self.rank}.json"))
        self.prof = None

    def dump_snapshot(self) -> None:
        if self.snapshot:
            self.dir.mkdir(parents=True, exist_ok=True)
            file = self.dir / f"memory_snapshot_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(file))

    def close(self) -> None:
        """The end of the run: a trace still open is written (a run resumed past A, or
        stopped early), the memory snapshot dumped and its recording stopped."""
        if self.prof is not None:
            self.write_trace()
        if self.snapshot:
            self.dump_snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
