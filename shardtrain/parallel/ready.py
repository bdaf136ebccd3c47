"""Start gradient communication group by group as backward completes each group, in one
fixed order on every rank.

Data parallelism's buckets and ZeRO-2/3's units follow the same rule (Li et al. 2020,
"PyTorch Distributed", sec. 3.2.3): a post-accumulate-grad hook counts the gradients still
due in each group; once the next group in launch order is complete it is launched, and so
is every complete group after it. Launching strictly in order matters because collectives
must be issued in the same order on every rank, and the order in which gradients become
ready may differ between ranks. Groups whose gradients never all arrive (parameters unused
in this step: an expert no token chose) are launched by `drain`, in order, so every rank
issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from torch import nn


class ReadyInOrder:
    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], launch: Callable[[int], None],
                 arrivals: Mapping[nn.Parameter, int] | None = None):
        """`groups`: the parameters of each group, in launch order (roughly the order
        backward produces them: last layer first); `launch(i)` starts group i's
        communication. A parameter belongs to one group. `arrivals`: how many communicating
        backwards accumulate into a parameter per step, where more than one (a tied table
        both of whose uses are on this rank, in two pipeline chunks: each chunk's last
        backward communicates, and the table is complete only after both)."""
        arrivals = arrivals or {}
        self.sizes = [sum(arrivals.get(p, 1) for p in g) for g in groups]
        self._launch = launch
        self._group_of = {p: i for i, g in enumerate(groups) for p in g}
        self.enabled = True  # False: hooks only count nothing (accumulation micro-steps)
        self.pending: list[int] = []  # gradients still due in this backward, per group
        self.next = 0  # the next group to launch
        for p in self._group_of:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.reset()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks count nothing inside: an accumulation micro-step, whose gradients add up
        locally and move only in the step's last backward."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def reset(self) -> None:
        self.next = 0
        self.pending = list(self.sizes)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        self.pending[self._group_of[param]] -= 1
        while self.next < len(self.sizes) and self.pending[self.next] == 0:
            self._start_next()

    def drain(self) -> None:
        """Launch every group not launched yet, in order (the caller waits, then resets)."""
        while self.next < len(self.sizes):
            self._start_next()

    def _start_next(self) -> None:
        i, self.next = self.next, self.next + 1
        self._launch(i)
