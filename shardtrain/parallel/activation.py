"""Activation checkpointing per transformer block (Chen et al. 2016): a block keeps only
its input during forward and recomputes its activations in backward.

The block's `forward` is replaced on the instance rather than the block being wrapped in
another module, so parameter names and checkpoints are the same with and without it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
