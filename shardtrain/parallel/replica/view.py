"""What the replica sync modes (sync.py) see of a layout's update half: the tensors its
optimizer reads and writes, whatever the layout (plain DP's gradient buckets and module
parameters, ZeRO's gradient and fp32 master shards, tp/pp locals, LoRA's adapters: only
what the optimizer holds), and how state laid out like the weights is checkpointed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardtrain.ckpt.files import Piece, Reader

KeyOf = Callable[[str], str]  # a parameter's single-process name -> a checkpoint key


@dataclass(frozen=True)
class ReplicaView:
    # The gradients the optimizer step reads, after the inner sync (flat buffers or
    # tensors; padding included: averaging zeros is harmless). A call: ZeRO's reducer
    # sets each step's gradient shards anew.
    grads: Callable[[], list[torch.Tensor]]
    # The weights the optimizer updates (fp32 masters where the layout keeps them).
    weights: list[torch.Tensor]
    # After `weights` changed outside the optimizer: the compute copies, as the update does
    # after its step (ZeRO-1/2: cast and all-gather the shards; plain DP: nothing).
    refresh: Callable[[], None]
    # Checkpoint pieces of tensors laid out like `weights` (one per weight, same shape),
    # under key_of(parameter name): layout-independent, as the weights' own pieces.
    pieces: Callable[[KeyOf, list[torch.Tensor]], list[Piece]]
    # Fill such tensors from a checkpoint of any layout; False where it has none.
    load: Callable[[Reader, KeyOf, list[torch.Tensor]], bool]
