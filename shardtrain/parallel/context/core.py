"""ContextAttention: the attention core a context-parallel layout puts on every Attention
module (`attn.core = ContextAttention(...)`), ring or Ulysses, with its compute clock."""

from __future__ import annotations

import torch

from shardtrain.comm import Communicator
from shardtrain.model.positions import Documents
from shardtrain.parallel.context.balance import balanced
from shardtrain.parallel.context.inputs import check_group
from shardtrain.parallel.context.ring import ring_attention
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.context.timer import ComputeTimer
from shardtrain.parallel.context.ulysses import ulysses_attention

MODES = {"ring": ring_attention, "ulysses": ulysses_attention}


class ContextAttention:
    """Causal attention of this rank's q [B, H, s, D] over k, v [B, G, s, D] (s = S/N, the
    tokens `split` gives comm.rank) with the other cp ranks -> [B, H, s, D]. `compute_s`:
    seconds this rank spent computing attention (forward and backward, not waiting for
    messages) since the last `reset()`.

    `recomputes_in_backward`: selective recomputation leaves this core alone (parallel/
    activation.py). The ring's autograd Function keeps only q, k, v, out and lse already;
    a checkpoint around Ulysses would replay its all-to-alls in backward."""

    recomputes_in_backward = True

    def __init__(self, comm: Communicator, split: SequenceSplit, mode: str):
        if mode not in MODES:
            raise ValueError(f"context attention mode {mode!r} is not one of "
                             f"{', '.join(MODES)}")
        check_group(comm.size, split, f"{mode} context attention")
        self.comm, self.split, self.mode = comm, split, mode
        self.timer = ComputeTimer(comm.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: Documents | None = None) -> torch.Tensor:
        return self.attend(q, k, v, documents)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None = None) -> torch.Tensor:
        """The exchanges and the attention (inside each of `documents`, the full rows'
        packed documents, when given, over the split's chunks paired by their work). Compiled blocks leave it eager (train.compile:
        parallel/compile.py wraps it per instance, so importing this module does not import
        torch's compiler)."""
        split = self.split if documents is None else balanced(self.split, documents)
        return MODES[self.mode](q, k, v, comm=self.comm, split=split, causal=True,
                                timer=self.timer, documents=documents)

    @property
    def compute_s(self) -> float:
        return self.timer.seconds

    def reset(self) -> None:
        self.timer.reset()

    def __repr__(self) -> str:
        return (f"ContextAttention({self.mode}, cp rank {self.comm.rank} of {self.comm.size}, "
                f"{'zig-zag' if self.split.zigzag else 'contiguous'} split)")
