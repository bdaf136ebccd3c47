"""A straggler on purpose (`train.slow_ranks`, e.g. "1:1.5"): the named ranks' compute takes
`factor` times as long, for studies of what a slow worker does to synchronous, asynchronous
and stale-synchronous training (seed 001: "If one GPU is slower than the others, the faster
GPUs must wait").

After each forward of the model the rank sleeps (factor - 1) x 3 x the forward's CPU time on
this thread: a backward costs about twice its forward, so forward + backward take about
`factor` times their own time. Thread CPU time, not wall time, so that time spent waiting for
communication inside the forward (a parameter-server worker waiting for its pulls) is not
stretched as if it were compute.

Finding a straggler that was not ordered -- each rank's compute and wait seconds, and the
rule that names a rank persistently slower than its peers -- is train/pace.py's.
"""

from __future__ import annotations

import time

from torch import nn
from torch.utils.hooks import RemovableHandle

BACKWARD_PER_FORWARD = 2.0


def slow_down(module: nn.Module, factor: float) -> list[RemovableHandle]:
    """Stretch `module`'s compute by `factor` (1: no change, no hooks)."""
    if factor <= 1.0:
        return []
    start: list[float] = []

    def before(_module, _args) -> None:
        start.append(time.thread_time())

    def after(_module, _args, _out) -> None:
        cpu = time.thread_time() - start.pop()
        time.sleep((factor - 1.0) * (1.0 + BACKWARD_PER_FORWARD) * cpu)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
