"""Multi-token prediction: DeepSeek-V3's sequential MTP modules (Liu et al. 2024, arXiv
2412.19437, sec. 2.2), model.mtp_depth = D of them after the main model.

Module k (1..D) at position i combines the previous depth's hidden state h^{k-1}_i (depth
0: the main model's last block output, before the final norm) with the embedding of token
i + k, and predicts token i + k + 1 (eq. 21-23):

    h'_i  = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]      M_k: [C, 2C], no bias
    h^k_i = Block_k(h'_i)                                           one block of the model's kind
    P^k_i = Head(Norm_k(h^k_i))                                     the shared head

The embedding and the head are the model's own (shared, as in the paper); each module has
its own output norm, as DeepSeek-V3's released weights do (`shared_head.norm`). Block_k has
a dense MLP of model.ffn_dim even in a mixture-of-experts model: the module stays out of
expert parallelism's dispatch and of the expert-bias state, and its cost is that of one
dense block (DeepSeek-V3's own MTP block routes to experts; docs/moe.md says why not here).

The sequence keeps its length S at every depth (the paper trims it to S - k): position
i >= S - k has no token i + k in the row, so its embedding input is a pad (token 0) and its
target IGNORE; causal attention keeps such positions out of every earlier one, so the
positions i < S - k compute exactly the paper's trimmed sequence, and every depth's
activations keep the main blocks' shape (sequence parallelism splits them alike).

Targets (`depth_targets`): depth k's target at i is the main target at i + k (token
i + k + 1), so a target the data masks (IGNORE: chat's prompts and padding) stays masked.
With packed documents (data.document_mask) it is also IGNORE unless token i + k + 1 lies in
token i's document; beyond the row (i + k + 1 = S) the document is unknown, so ignored.
The depths' input tokens and targets are built from whole rows (`depth_batch`, by the
pipeline before context parallelism splits the sequence: parallel/pipeline/runtime.py),
so a rank holding a slice of the row gets them for its own positions.

The modules run in training only: in eval mode (evaluation, sampling, export) the model
is the main model alone, and its eval loss the next-token loss, comparable across runs.
Shape legend: B batch, S sequence, C dim, V vocabulary, D depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.config import ModelConfig
from shardtrain.config.data import IGNORE


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection M_k, a block and the output norm.
    `block` and `norm` come from the model (model/transformer.py), so the module is built of
    the model's own kind of block and norm."""

    def __init__(self, cfg: ModelConfig, *, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.h_norm, self.e_norm = norm(), norm()
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.out_norm = norm()

    def forward(self, h: torch.Tensor, e: torch.Tensor, rope, documents) -> torch.Tensor:
        """h: the previous depth's hidden state, e: the shifted tokens' embedding, each
        [B, S, C] (under sequence parallelism [B, S/t, C]) -> this depth's [B, S, C]."""
        x = self.proj(torch.cat([self.h_norm(h), self.e_norm(e)], dim=-1))  # [B, S, C]
        # The residual stream in h's dtype (the precision policy's, fp32 under bf16 autocast),
        # as the main blocks' starts from the embedding's, not in the projection's bf16.
        return self.block(x.to(h.dtype), rope, documents)


@dataclass
class MTPOutput:
    """The training forward's output with multi-token prediction: the main logits and
    each depth's."""
    logits: torch.Tensor  # [B, S, V] (or [B, S, V/t] under tensor parallelism)
    depths: list[torch.Tensor]  # D x the same shape


def shifted(tokens: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """tokens [B, S] moved k to the left, the last k positions `fill`."""
    pad = torch.full_like(tokens[:, :k], fill)
    return torch.cat([tokens[:, k:], pad], dim=1)


def same_document(positions: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S] bool: token i + k + 1 lies in token i's document. Positions count from 0 in
    each document and rise by one per token inside it, so that holds exactly when
    positions[i + k + 1] = positions[i] + k + 1 (a document starting in between numbers
    token i + k + 1 at most k); i + k + 1 >= S lies outside the row: False."""
    ahead = shifted(positions, k + 1, -1)  # [B, S], -1 beyond the row
    return ahead.eq(positions + k + 1)


def depth_targets(targets: torch.Tensor, k: int, same_doc: torch.Tensor | None
                  ) -> torch.Tensor:
    """Depth k's targets [B, S]: the main target at i + k (token i + k + 1), IGNORE beyond
    the row and, with packed documents, where it leaves token i's document."""
    out = shifted(targets, k, IGNORE)
    return out if same_doc is None else out.masked_fill(~same_doc, IGNORE)


def depth_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, S, D]: depth k's input token at i, token i + k (0 past the row's end)."""
    return torch.stack([shifted(tokens, k, 0) for k in range(1, depth + 1)], dim=-1)


def depth_batch(inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole rows [B, S] -> (the depths' input tokens [B, S, D], the targets [B, S, 1 + D]:
    the main ones, then each depth's). Built before a layout splits the sequence (context
    parallelism), so a rank's tokens get theirs from wherever in the row they lie."""
    docs = [None if positions is None else same_document(positions, k)
            for k in range(1, depth + 1)]
    stacked = [targets, *(depth_targets(targets, k, d) for k, d in enumerate(docs, 1))]
    return depth_tokens(inputs, depth), torch.stack(stacked, dim=-1)


def mtp_forward(owner: nn.Module, h: torch.Tensor, tokens: torch.Tensor,
                logits: torch.Tensor, rope, documents) -> MTPOutput:
    """The D depths after the main model. `owner` holds `tok_emb`, `head` and `mtp` (the
    model, or the pipeline's last stage); h [B, S, C]: the last block's output; tokens
    [B, S, D]: each depth's input tokens (`depth_batch`)."""
    depths = []
    for k, module in enumerate(owner.mtp):
        e = owner.tok_emb(tokens[..., k])  # [B, S, C]: Emb(t_{i+k+1}), depth k + 1
        h = module(h, e, rope, documents)
        depths.append(owner.head(module.out_norm(h)))  # [B, S, V]
    return MTPOutput(logits, depths)


BaseLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean


class MTPLoss:
    """The training objective L_main + coef / D * sum_k L_k (DeepSeek-V3 eq. 24-25): L_main
    the mean over the counted targets by `base` (the plain or the vocab-parallel
    cross-entropy: parallel/tensor/vocab.py); L_k, as eq. 24 writes it, depth k's summed
    token losses over the same count T of main targets (not over its own, fewer, counted
    ones): a micro-batch's sum then adds up to the batch's whatever slice of the rows a
    rank holds (under context parallelism the row ends, whose depth targets are ignored,
    sit on one rank). targets [B, S, 1 + D] (`depth_batch`). Returns (objective,
    [L_main, L_1..L_D] detached) for a training forward's `MTPOutput`, the main loss for
    eval logits."""

    def __init__(self, base: BaseLoss, cfg: ModelConfig):
        self.base, self.coef, self.depth = base, cfg.mtp_loss_coef, cfg.mtp_depth

    def __call__(self, out: torch.Tensor | MTPOutput, targets: torch.Tensor):
        main = self.base(out if isinstance(out, torch.Tensor) else out.logits, targets[..., 0])
        if isinstance(out, torch.Tensor):
            return main
        counted = targets.ne(IGNORE).flatten(0, -2).sum(0)  # [1 + D] on the device
        per_main = counted[1:] / counted[0].clamp(min=1)  # [D]: each depth's mean -> / T
        parts = torch.stack([self.base(logits, targets[..., k])
                             for k, logits in enumerate(out.depths, 1)]) * per_main  # [D]
        objective = main + (self.coef / self.depth) * parts.sum()
        return objective, torch.cat([main[None], parts]).detach()  # [1 + D]
