"""The mixture-of-experts block (Shazeer et al. 2017), in three separable steps.

- `route` (moe_routing.py): a linear router in fp32, softmax or sigmoid scores, top-k
  (steered by the expert bias under auxiliary-loss-free balancing), the gates.
- `dispatch`: the token-slots (token, choice) sorted by expert, with per-expert counts and
  device-side group offsets; a capacity (GShard, Lepikhin et al. 2020; Switch, Fedus et
  al. 2021) drops the slots an over-full expert cannot take, by router probability or by
  position. `experts_grouped` runs each projection as one grouped matmul over the sorted
  slots (no host sync); `experts_looped` is the per-expert loop it replaces (experts.py).
- `combine`: the inverse permutation, each slot weighted by its router weight.
Expert parallelism (later) puts an all-to-all between dispatch and the experts and its
inverse before combine; the model itself knows nothing of ranks.

Auxiliary losses: Switch's load-balancing loss E * sum_i f_i P_i, or DeepSeek-V3's
sequence-wise one beside the expert bias, and ST-MoE's router z-loss
mean(logsumexp(logits)^2) (Zoph et al. 2022). Their gradient enters through `_AuxGrad`, an
identity on the block's output whose backward also feeds d(coef * loss) to the router,
scaled like the main loss's gradient (`loss_grad_scale`), so no stage adds a loss of its
own to the pipeline's. Shape legend: T tokens, K top-k, N = T * K slots, E experts, C dim,
F expert hidden width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.config import ModelConfig
from shardtrain.model.experts import Experts
from shardtrain.model.mlp import MLP
from shardtrain.model.moe_routing import (Routing, balance_loss, bias_step, expert_counts,
                                          route, row_counts, sequence_balance_loss, z_loss)

# The factor the training loss's gradient is scaled by (the pipeline executor scales each
# micro-batch's loss by loss_scale / m before backward and sets this around its forwards:
# parallel/pipeline/executor.py). A float, not a process group: 1 outside the executor,
# where a plain loss.backward() of the mean loss is the convention.
_LOSS_GRAD_SCALE = 1.0


@contextmanager
def loss_grad_scale(scale: float):
    """Forwards run inside this block scale the auxiliary losses' gradients by `scale`, as
    the main loss's gradient is (read when the MoE block runs forward, kept for backward)."""
    global _LOSS_GRAD_SCALE
    previous, _LOSS_GRAD_SCALE = _LOSS_GRAD_SCALE, scale
    try:
        yield
    finally:
        _LOSS_GRAD_SCALE = previous


@dataclass
class Dispatch:
    """The N token-slots sorted by expert, kept slots first (grouped by expert), dropped
    ones (over capacity) after all groups."""
    token: torch.Tensor  # [N] int64, the token each sorted slot reads
    expert: torch.Tensor  # [N] int64, its expert
    weight: torch.Tensor  # [N] fp32, its router weight, 0 where dropped
    keep: torch.Tensor  # [N] bool
    counts: torch.Tensor  # [E] int64, kept slots per expert
    offsets: torch.Tensor  # [E] int32, end of each expert's group (cumulative counts)
    routed: torch.Tensor  # [E] int64, slots routed to each expert before drops


def capacity(cfg: ModelConfig, n_tokens: int) -> int | None:
    """Slots per expert for `n_tokens` tokens: ceil(factor * T * K / E); None: dropless."""
    if cfg.moe_capacity_factor <= 0:
        return None
    return math.ceil(cfg.moe_capacity_factor * n_tokens * cfg.moe_top_k / cfg.n_experts)


def dispatch(tokens: torch.Tensor, r: Routing, cap: int | None,
             policy: str = "probs") -> tuple[torch.Tensor, Dispatch]:
    """tokens [T, C] -> the sorted slots' inputs [N, C] (zero rows where dropped) and the
    bookkeeping `combine` needs (`sort_slots`)."""
    d = sort_slots(r, cap, policy)
    return slot_inputs(tokens, d), d


def slot_inputs(tokens: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """The sorted slots' inputs [N, C], zero rows where dropped."""
    # where, not a product: rows outside every group are never read as numbers.
    return torch.where(d.keep[:, None], tokens[d.token], 0.0)


def sort_slots(r: Routing, cap: int | None, policy: str = "probs") -> Dispatch:
    """The N slots sorted by expert, kept ones first. Over capacity, an expert keeps its
    `cap` slots of highest router probability (`probs`) or of the earliest tokens
    (`position`; slot order is token-major: token t's choices are slots t*K .. t*K+K-1)."""
    n_experts, top_k = r.probs.shape[-1], r.experts.shape[-1]
    flat = r.experts.reshape(-1)  # [N]
    routed = expert_counts(flat, n_experts)
    slots = torch.arange(flat.numel(), device=flat.device)
    if cap is not None:
        if policy == "probs":  # by probability first; the stable sort by expert keeps it
            slots = r.probs.gather(1, r.experts).reshape(-1).argsort(descending=True, stable=True)
        slots = slots[flat[slots].argsort(stable=True)]  # grouped by expert, in priority
        starts = routed.cumsum(0) - routed  # [E]
        rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[slots]]
        keep_sorted = rank < cap
        # Kept slots to the front (expert order), dropped after every group.
        order = torch.where(keep_sorted, flat[slots], n_experts).argsort(stable=True)
        slots, keep = slots[order], keep_sorted[order]
        counts = routed.clamp(max=cap)
    else:
        slots = flat.argsort(stable=True)
        keep = torch.ones_like(slots, dtype=torch.bool)
        counts = routed
    token = slots // top_k
    weight = torch.where(keep, r.weights.reshape(-1)[slots], 0.0)
    return Dispatch(token, flat[slots], weight, keep, counts,
                    counts.cumsum(0).to(torch.int32), routed)


def combine(y: torch.Tensor, d: Dispatch, n_tokens: int) -> torch.Tensor:
    """The experts' outputs y [N, C] (sorted slots) -> [T, C]: each token's slots summed,
    weighted by the router; a dropped slot adds nothing (its token keeps the residual)."""
    y = torch.where(d.keep[:, None], y, 0.0) * d.weight[:, None].to(y.dtype)
    return y.new_zeros(n_tokens, y.shape[-1]).index_add_(0, d.token, y)


class _AuxGrad(torch.autograd.Function):
    """Identity on `out`; backward also returns `scale` as the gradient of `aux` (the
    weighted auxiliary losses), `scale` being the main loss's gradient factor."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.scale = _LOSS_GRAD_SCALE
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, device=grad.device)


class MoE(nn.Module):
    """route -> dispatch -> experts -> combine, plus the auxiliary losses' gradient. While
    training, `stats` sums per forward [balance loss, z-loss, dropped slots, routed slots
    per expert (E), the token group's routed slots per expert (E)] on the device;
    `take_stats` hands them over and resets.

    Under moe_balance = bias, `expert_bias` [E] fp32 steers the choice: a buffer (state
    a checkpoint holds and layouts reshard, never the optimizer's), moved once per step
    from the whole step's load (`update_expert_biases`).

    Shared experts (DeepSeekMoE, Dai et al. 2024): `shared`, one dense MLP of
    moe_shared_experts x the expert width that every token passes through, added to the
    routed output ungated; dense like a block's MLP, so every layout treats it as one."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = MLP(cfg, cfg.moe_shared_experts * cfg.expert_hidden) \
            if cfg.moe_shared_experts else None
        if cfg.moe_balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.layer = layer  # the block's index in the model: per-layer stats rows
        self.stats: torch.Tensor | None = None  # [3 + 2E] fp32
        self.forwards = 0
        # When a micro-batch's tokens are split over ranks (context parallelism, sequence
        # parallelism: parallel/expert/groups.py), f of the balance loss counts the whole
        # group's slots (`group_counts` sums [E] over those ranks), and `aux_scale` weights
        # the auxiliary losses' gradient so that the ranks' parts add up to the loss of the
        # whole micro-batch. Identity and 1 on one rank.
        self.group_counts: Callable[[torch.Tensor], torch.Tensor] = lambda routed: routed
        self.aux_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.reshape(-1, x.shape[-1])  # [T, C] (x [B, S, C], S this rank's share)
        bias = self.expert_bias if cfg.moe_balance == "bias" else None
        limit = (cfg.moe_groups, cfg.moe_max_groups) if cfg.moe_max_groups else None
        r = route(tokens, self.router, cfg.moe_top_k, cfg.moe_score, bias, limit,
                  cfg.moe_route_scale)
        d = sort_slots(r, capacity(cfg, tokens.shape[0]), cfg.moe_drop_policy)
        if getattr(self.experts, "grouped", False):  # ep's exchange, one row per group
            y = self.experts.exchange_grouped(tokens, r, d)  # [T, C], combined
        else:
            y = combine(self.experts(slot_inputs(tokens, d), d), d, tokens.shape[0])
        out = y.to(x.dtype).view_as(x)
        if self.shared is not None:
            out = out + self.shared(x)
        if not self.training:  # the auxiliary losses and stats are training's
            return out
        group = self.group_counts(d.routed)  # [E]: the whole token group's
        if cfg.moe_balance == "bias":
            counts = row_counts(r.experts, x.shape[0], cfg.n_experts)  # [B, E]
            balance = sequence_balance_loss(r, self.group_counts(counts))
        else:
            balance = balance_loss(r, group)
        z = z_loss(r)
        if torch.is_grad_enabled() and (cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef):
            aux = cfg.moe_aux_loss_coef * balance + cfg.moe_z_loss_coef * z
            out = _AuxGrad.apply(out, aux * self.aux_scale)
        # A forward rerun by activation recomputation happens inside backward: not counted.
        if torch._C._current_graph_task_id() == -1:
            dropped = (d.routed - d.counts).sum()
            row = torch.cat([torch.stack([balance.detach(), z.detach(), dropped.float()]),
                             d.routed.float(), group.float()])
            self.stats = row if self.stats is None else self.stats + row
            self.forwards += 1
        return out

    def take_stats(self) -> tuple[torch.Tensor | None, int]:
        """(the summed stats row [3 + 2E] or None, the forwards it covers); resets."""
        stats, forwards = self.stats, self.forwards
        self.stats, self.forwards = None, 0
        return stats, forwards


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def moe_stats(module: nn.Module, cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The MoE layers of `module` (a model or a pipeline stage) since the last call, as a
    vector that sums across ranks: [balance-loss sum, z-loss sum, layer-forwards, dropped
    slots, sum over layers of the per-expert routed counts' coefficient of variation
    (std / mean, population std), layers], then per layer of the model (L rows, zeros
    for the layers held elsewhere) its token group's routed slots per expert (E) and its
    dropped slots: [6 + L (E + 1)], the same size on every stage (one holding no MoE
    layer, model.moe_first_dense, sends zeros). Resets the layers' stats."""
    total = torch.zeros(6, device=device)
    rows = torch.zeros(cfg.n_layers, cfg.n_experts + 1, device=device)  # [L, E + 1]
    for layer in moe_layers(module):
        stats, forwards = layer.take_stats()
        if stats is None:
            continue
        e = layer.cfg.n_experts
        counts = stats[3:3 + e]
        cv = counts.std(correction=0) / counts.mean().clamp(min=1)
        # new_full fills on the device; new_tensor would copy a host scalar there, blocking
        total += torch.stack([stats[0], stats[1], total.new_full((), forwards), stats[2],
                              cv, total.new_ones(())])
        rows[layer.layer, :e] += stats[3 + e:]
        rows[layer.layer, e] += stats[2]
    return torch.cat([total, rows.reshape(-1)])


def update_expert_biases(module: nn.Module, totals: torch.Tensor) -> None:
    """Move every expert bias of `module` by its layer's load in `totals` (`moe_stats`
    summed over every rank that routes other tokens, so every replica moves it alike)."""
    for layer in moe_layers(module):
        if layer.cfg.moe_balance == "bias":
            e = layer.cfg.n_experts
            load = totals[6:].view(layer.cfg.n_layers, e + 1)[layer.layer, :e]
            bias_step(layer.expert_bias, load, layer.cfg.moe_bias_rate)


def layer_balance(totals: list[float], cfg: ModelConfig) -> dict[str, list[float | None]]:
    """Per layer, from `moe_stats` totals read on the host (plain floats): MaxVio of the
    step's load, max load / mean load - 1 (Wang et al. 2024 sec. 4.1: 0 when even), and
    the dropped slots; None for a dense block (model.moe_first_dense)."""
    e, per = cfg.n_experts, totals[6:]
    rows = [per[i:i + e + 1] for i in range(0, len(per), e + 1)]
    return {"moe_maxvio": [round(max(r[:e]) * e / max(sum(r[:e]), 1e-9) - 1, 6)
                           if cfg.is_moe(i) else None for i, r in enumerate(rows)],
            "moe_dropped_layers": [int(r[e]) if cfg.is_moe(i) else None
                                   for i, r in enumerate(rows)]}
