"""The micro-batches' host tensors on the device, one micro-batch ahead (executor.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Feed:
    """The micro-batches' host tensors on the device, each copied one micro-batch ahead of
    its use (taking micro-batch i of a kind issues the copy of i + 1). On a GPU a host
    tensor is pinned first (on the host) and copied with non_blocking=True on the current
    stream, which orders it before the kernels reading it; torch's host allocator keeps
    the pinned block from reuse until the copy has run. On CPU pinning is skipped and the
    copy is none (the tensor is already there): the same code path."""

    def __init__(self, device: torch.device, **tensors: Sequence[torch.Tensor] | None):
        """`tensors`: kind -> one host tensor per micro-batch (None: the kind is absent)."""
        self.device, self.pin = device, device.type == "cuda"
        self.host = {kind: ts for kind, ts in tensors.items() if ts is not None}
        self.staged: dict[tuple[str, int], torch.Tensor] = {}

    def has(self, kind: str) -> bool:
        return kind in self.host

    def take(self, kind: str, mb: int) -> torch.Tensor:
        """Micro-batch `mb`'s `kind` on the device. Inputs and targets are read once;
        positions go to every local chunk, so they stay."""
        x = self._stage(kind, mb)
        if kind != "positions":
            del self.staged[(kind, mb)]
        if mb + 1 < len(self.host[kind]):
            self._stage(kind, mb + 1)
        return x

    def _stage(self, kind: str, mb: int) -> torch.Tensor:
        if (kind, mb) not in self.staged:
            x = self.host[kind][mb]
            if self.pin and x.device.type == "cpu" and not x.is_pinned():
                x = x.pin_memory()
            self.staged[(kind, mb)] = x.to(self.device, non_blocking=True)
        return self.staged[(kind, mb)]
