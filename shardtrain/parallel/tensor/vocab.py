"""The vocabulary split over tensor-parallel ranks: embedding and cross-entropy.

Rank r holds rows [r V'/t, (r+1) V'/t) of the embedding (and of the output head, whose
weight it may share), V' being the vocabulary padded to a multiple of t. The embedding looks
up the tokens in its range, zeroes the others and all-reduces (Megatron's g); the loss
works on the [B, S, V'/t] logit shards and never builds the full [B, S, V] logits on one
rank (Shoeybi et al. 2019, sec. 3): a max and two sums are all-reduced, and the gradient is
softmax minus one-hot, computed locally. Padding columns are masked out of the softmax.

Both losses average over the tokens that count: a target of IGNORE (-100, chat's prompt
tokens and padding: data/chat_rows.py) adds nothing, and a micro-batch with no counted
token has loss 0 (not 0/0). With every target counted they are the plain mean, bit for bit
as before targets could be ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from shardtrain.comm import Communicator
from shardtrain.config.data import IGNORE
from shardtrain.parallel.tensor.ops import ReduceFromRegion, TAG, handle


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean loss over the counted tokens of the plain model: logits [B, S, V], targets
    [B, S]."""
    targets = targets.flatten()
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets, ignore_index=IGNORE)
    # No counted token: F.cross_entropy gives 0/0; the gradient through `where` is then 0.
    return torch.where(targets.ne(IGNORE).any(), loss, torch.zeros_like(loss))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, *, start: int, comm: Communicator):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [V'/t, C]
        self.start, self.comm = start, handle(comm)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # [B, S]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, S, C]
        x = x.masked_fill(outside[..., None], 0.0)
        return ReduceFromRegion.apply(x, self.comm)


class VocabParallelCrossEntropy:
    """The mean token loss from vocab-sharded logits [B, S, V'/t] and targets [B, S]."""

    def __init__(self, *, start: int, vocab_size: int, comm: Communicator):
        self.start, self.vocab_size, self.comm = start, vocab_size, comm

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.flatten()
        losses = _VocabParallelCE.apply(logits.float().flatten(0, 1), targets,
                                        self.start, self.vocab_size, self.comm)  # [N]
        counted = targets.ne(IGNORE)  # [N]
        # Every token counted: the plain mean (mean multiplies by 1/N, which a division by
        # the count need not round alike); else the counted tokens' sum over their count.
        masked = losses.masked_fill(~counted, 0.0).sum() / counted.sum().clamp(min=1)
        return torch.where(counted.all(), losses.mean(), masked)


class _VocabParallelCE(Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int,
                comm: Communicator) -> torch.Tensor:
        n, width = logits.shape  # [N, V'/t]
        padding = torch.arange(start, start + width, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
        peak = logits.max(dim=-1).values  # [N]
        comm.all_reduce(peak, "max", tag=TAG)
        shifted = logits - peak[:, None]  # [N, V'/t]
        local = targets - start
        mine = (local >= 0) & (local < width)  # [N]: the target column is on this rank
        local = local.masked_fill(~mine, 0)
        sums = torch.stack([shifted.exp().sum(-1),  # softmax denominator  [2, N]
                            shifted.gather(1, local[:, None])[:, 0].masked_fill(~mine, 0.0)])
        comm.all_reduce(sums, "sum", tag=TAG)
        softmax = shifted.exp_().div_(sums[0, :, None])  # [N, V'/t]
        ctx.save_for_backward(softmax, local, mine)
        return sums[0].log() - sums[1]  # [N]: log sum exp - target logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()  # d loss / d logits = softmax - one-hot(target)
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        return grad_logits.mul_(grad[:, None]), None, None, None, None
