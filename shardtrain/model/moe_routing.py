"""Which experts a token goes to, with what weight, and the losses and bias that balance
the experts' load.

Scores (`model.moe_score`):
- softmax: probabilities over the E experts (Switch, Fedus et al. 2021; Mixtral).
- sigmoid: one independent affinity per expert in (0, 1) (DeepSeek-V3, arXiv 2412.19437,
  eq. 15); `probs` are then the affinities normalised over the experts, the share the
  balance losses read.
Top-k picks the k highest scores, plus the expert bias under `moe_balance = bias` (the bias
steers the choice only; the gates use the unbiased scores). The gates: for k > 1 the chosen
scores normalised over the k chosen (Mixtral; DeepSeek-V3 eq. 13); for k = 1 the chosen
score itself, as Switch gates (sec. 2.1): normalised over one choice every gate would be
1, and the router would learn nothing from the task loss.

Balance (`model.moe_balance`):
- aux: Switch's E * sum_i f_i P_i over the micro-batch (`balance_loss`).
- bias: auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3
  sec. 2.1.2): after each step b_i += rate * sign(mean load - load_i) (`bias_step`), with
  the sequence-wise loss (DeepSeek-V3 eqs. 17-20, `sequence_balance_loss`) beside it.
- none: neither.

Group-limited routing (`model.moe_groups = G`, `model.moe_max_groups = g`; DeepSeek-V2
sec. 2.2.3 device-limited, DeepSeek-V3 sec. 2.1.2 node-limited): the E experts form G
groups of E / G consecutive experts; a group's score is the sum of its two highest
selection scores (its one highest where a group holds one expert), each token keeps its g
highest-scoring groups, and top-k picks among their experts only. Every layout computes
the same choice; placed one group per ep rank (or several whole groups per rank), a token's
slots reach at most g ranks, which the exchange then sends the token once
(parallel/expert/grouped.py).
Shape legend: T tokens, B sequences, K top-k, E experts, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    logits: torch.Tensor  # [T, E] fp32
    probs: torch.Tensor  # [T, E] fp32: softmax of logits, or the normalised affinities
    weights: torch.Tensor  # [T, K] fp32: the gates (`route`)
    experts: torch.Tensor  # [T, K] int64, the chosen experts
    groups: torch.Tensor | None = None  # [T, g] int64: the kept groups, if limited


def route(tokens: torch.Tensor, router: nn.Linear, top_k: int, score: str = "softmax",
          bias: torch.Tensor | None = None, groups: tuple[int, int] | None = None,
          scale: float = 1.0) -> Routing:
    """Router in fp32 (autocast off: small logit differences decide the choice); `bias`
    [E] added to the scores for the choice only; `groups` (G, g): the choice limited to
    each token's g best of G expert groups (see the module docstring); `scale`: the gates'
    factor (model.moe_route_scale, DeepSeek-V3's routed_scaling_factor)."""
    with torch.autocast(tokens.device.type, enabled=False):  # called: layouts hook modules
        # in the router's dtype: fp32, or 16-bit weights (bf16-true, fp16-true), whose
        # logits are widened before the softmax
        logits = router(tokens.to(router.weight.dtype)).float()  # [T, E]
    if score == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        scores = probs = logits.softmax(-1)
    # The choice (no gradient through it: topk's indices have none anyway)
    choice = scores.detach() if bias is None else scores.detach() + bias  # [T, E]
    kept = None
    if groups is not None:
        choice, kept = limit_groups(choice, *groups)
    experts = choice.topk(top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, experts)
    if top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return Routing(logits, probs, weights, experts, kept)


def limit_groups(choice: torch.Tensor, n_groups: int, max_groups: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """choice [T, E] -> (choice with the experts outside each token's `max_groups` best
    groups at -inf, those groups [T, g] int64 in ascending order)."""
    t, e = choice.shape
    per = choice.view(t, n_groups, e // n_groups)  # [T, G, E/G]
    score = per.topk(min(2, e // n_groups), dim=-1).values.sum(-1)  # [T, G]
    kept = score.topk(max_groups, dim=-1).indices.sort(-1).values  # [T, g]
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
    return per.masked_fill(~mask[..., None], float("-inf")).view(t, e), kept


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert [E] int64, on the device (scatter_add: bincount would sync)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def row_counts(experts: torch.Tensor, rows: int, n_experts: int) -> torch.Tensor:
    """Slots per expert of each sequence [B, E] int64 (experts [T, K], T = B x tokens per
    row, row-major), on the device."""
    per_row = experts.reshape(rows, -1)  # [B, (T/B) K]
    return torch.zeros(rows, n_experts, dtype=torch.int64, device=experts.device
                       ).scatter_add_(1, per_row, torch.ones_like(per_row))


def balance_loss(r: Routing, routed: torch.Tensor) -> torch.Tensor:
    """Switch's E * sum_i f_i P_i: f_i the fraction of the slots routed to expert i (before
    capacity drops; no gradient), P_i the mean router probability of expert i over these
    tokens. 1 when both are uniform; its gradient pushes probability off the busy experts.
    `routed` [E] may count a larger token group than these tokens (MoE.group_counts)."""
    n_experts = r.probs.shape[-1]
    f = routed.float() / routed.sum()  # [E]
    return n_experts * (f * r.probs.mean(0)).sum()


def sequence_balance_loss(r: Routing, routed_rows: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the B sequences: per sequence
    sum_i f_i P_i with f_i = E / (K T) x (slots of the sequence routed to i) and P_i the
    mean over its tokens of the normalised affinity of i (`probs`). `routed_rows` [B, E]
    may count the whole sequence where these tokens are a slice of it (cp, sp)."""
    rows, n_experts = routed_rows.shape
    f = n_experts * routed_rows.float() / routed_rows.sum(-1, keepdim=True)  # [B, E]
    p = r.probs.reshape(rows, -1, n_experts).mean(1)  # [B, E]
    return (f * p).sum(-1).mean()


def z_loss(r: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return torch.logsumexp(r.logits, dim=-1).square().mean()


@torch.no_grad()
def bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """b_i += rate * sign(mean load - load_i), in place: a busy expert's bias falls, an idle
    one's rises (Wang et al. 2024, Algorithm 1). `load` [E] may be any positive multiple
    of the true counts (the sign is the same)."""
    load = load.float()
    bias.add_(torch.sign(load.mean() - load), alpha=rate)
