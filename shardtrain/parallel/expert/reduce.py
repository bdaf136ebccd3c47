"""Gradient reduction under expert parallelism: the replicated parameters are averaged over
dp as plain data parallelism does (data/ddp.py); each expert parameter over `edp`, the dp
ranks holding the same experts. ZeRO shards and reduces the experts over edp too
(zero/model.py) and scales them by the same `expert_grad_scale`.

Scale: the loss is the mean over dp ranks of each rank's loss, so a parameter's gradient is
(1/dp) sum over ranks. An expert's owner already receives (by the all-to-all's backward)
the sum over its ep group's tokens; averaging over edp (dp / ep ranks) leaves a factor ep
too many: the average is multiplied by `expert_grad_scale(ep)` = 1/ep.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch import nn

from shardtrain.parallel.data.ddp import DataParallel
from shardtrain.parallel.expert.layers import ExpertSlice


def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
    return {p for m in module.modules() if isinstance(m, ExpertSlice) for p in m.parameters()}


def expert_grad_scale(ep: int) -> float:
    """The factor an expert gradient averaged over edp still needs (module docstring)."""
    return 1.0 / ep


class ExpertDataParallel:
    """Two bucketed reducers behind DataParallel's interface (what ReplicatedUpdate uses)."""

    def __init__(self, dense: DataParallel, experts: DataParallel, ep: int):
        self.reducers, self.experts, self.scale = (dense, experts), experts, expert_grad_scale(ep)
        self.buckets = dense.buckets + experts.buckets

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for r in self.reducers:
                stack.enter_context(r.no_sync())
            yield

    def zero_grad(self) -> None:
        for r in self.reducers:
            r.zero_grad()

    def finish(self) -> None:
        for r in self.reducers:
            r.finish()
        for b in self.experts.buckets:
            b.buffer.mul_(self.scale)

    @property
    def grad_bytes(self) -> int:
        return sum(r.grad_bytes for r in self.reducers)
