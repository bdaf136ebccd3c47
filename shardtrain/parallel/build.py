"""The sharded build: a rank materialises only what it keeps.

The model is built on the meta device (shapes only). `parallelize` then gives storage to
this rank's pipeline stage alone (stage.py), whose tensor-parallel and expert modules
already have their local shapes (tensor/, expert/). What the update half shards further --
ZeRO's trainable parameters -- stays on the meta device here, and ZeRO's flat units
(zero/units.py) give each rank its own share (stage 3: the shard alone; stages 1 and 2:
the unit, which they replicate).

Values arrive afterwards, one tensor at a time, through a `Target`: `wants(name)` says
whether this rank keeps any of parameter `name` (a ZeRO-3 rank of a 256-way group keeps a
few of each block's tensors, and need not draw or read the others), `write(name, value)`
puts this rank's local tensor (its tp/ep block) where it lives. A value source
(train/finetune/finetune.py `start_values`: the seeded draw by name, or a Hugging Face directory
streamed) is the same for every layout, so every layout starts from the single-process
weights, and the build's peak is the rank's share plus the one tensor in hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from shardtrain.model.hf import assign


class Target(Protocol):
    def wants(self, name: str) -> bool: ...

    def write(self, name: str, value: torch.Tensor) -> None: ...


Fill = Callable[[Target], None]  # writes every initial value into a target
Values = Callable[[Callable[[str], bool]], Iterable[tuple[str, torch.Tensor]]]


class ModuleTarget:
    """The module's own tensors: every parameter materialised whole (local shapes)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def wants(self, name: str) -> bool:
        return True

    def write(self, name: str, value: torch.Tensor) -> None:
        assign(self.module, name, value)


def filler(values: Values) -> Fill:
    """A Fill from a value source: each wanted (name, value) written as it is drawn."""
    @torch.no_grad()
    def fill(target: Target) -> None:
        for name, value in values(target.wants):
            target.write(name, value)
            del value  # before the next is drawn: one full tensor at a time
    return fill


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, *,
                leave: Callable[[nn.Parameter], bool] = lambda p: False,
                dtype: torch.dtype | None = None) -> None:
    """Give the meta tensors of `module` uninitialised storage on `device`, in place: each
    parameter stays the same object (tied parameters stay tied; holders of references,
    such as StageShards, stay valid). Parameters for which `leave(p)` holds stay on the
    meta device: ZeRO's units place them (zero/units.py). Floating-point parameters take
    `dtype` (the policy's parameter dtype: 16-bit under bf16-true and fp16-true, so no fp32
    copy of them ever exists; None: their own); buffers keep theirs (RoPE tables stay fp32)."""
    for p in list(module.parameters()):  # each tied parameter once
        if p.device.type == "meta" and not leave(p):
            data = torch.empty(p.shape, dtype=dtype if dtype and p.is_floating_point() else p.dtype,
                               device=device)
            torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
    for owner in module.modules():  # buffers: uninitialised on `device`, as to_empty does
        for name, b in list(owner._buffers.items()):
            if b is not None and b.device != device:
                owner._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
