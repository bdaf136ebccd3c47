"""The routed experts of a mixture-of-experts block: E MLPs stacked per projection, run
over the dispatched token-slots (model/moe.py `Dispatch`) by one grouped matmul per
projection or by a per-expert loop. Shape legend: N slots, C dim, F expert hidden width."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.config import ModelConfig

if TYPE_CHECKING:
    from shardtrain.model.moe import Dispatch


class Experts(nn.Module):
    """E expert MLPs, weights stacked per projection ([E, out, in], as nn.Linear stores
    one): SwiGLU w2(silu(w1 x) * w3 x) (llama) or GELU w2(gelu(w1 x + b1)) + b2 (gpt2; the
    biases flat [E * out], so the optimizer's ndim >= 2 decay rule leaves them alone)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, c, f = cfg.n_experts, cfg.dim, cfg.expert_hidden
        self.gated, self.impl = cfg.style == "llama", cfg.moe_impl
        self.w1 = nn.Parameter(torch.empty(e, f, c))
        self.w3 = nn.Parameter(torch.empty(e, f, c)) if self.gated else None
        self.w2 = nn.Parameter(torch.empty(e, c, f))
        self.b1 = None if self.gated else nn.Parameter(torch.empty(e * f))
        self.b2 = None if self.gated else nn.Parameter(torch.empty(e * c))

    def forward(self, x: torch.Tensor, d: Dispatch) -> torch.Tensor:
        """x [N, C] sorted slots -> [N, C]; rows after the last group are not computed."""
        mm = _grouped if self.impl == "grouped" else _looped
        if self.gated:
            h = F.silu(mm(x, self.w1, d)) * mm(x, self.w3, d)  # [N, F]
            return mm(h, self.w2, d)
        h = F.gelu(mm(x, self.w1, d) + self._bias(self.b1, d), approximate="tanh")
        return mm(h, self.w2, d) + self._bias(self.b2, d)

    def _bias(self, b: torch.Tensor, d: Dispatch) -> torch.Tensor:
        """Each sorted row's expert's bias [N, out]; 0 on dropped rows (no gradient from the
        rows outside every group, whose matmul values the grouped kernel leaves unset)."""
        rows = b.view(self.w1.shape[0], -1)[d.expert]
        return torch.where(d.keep[:, None], rows, 0.0)


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """What a linear would compute in: autocast's dtype where it is on (_grouped_mm has no
    autocast rule), else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _grouped(x: torch.Tensor, w: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """One grouped matmul: rows of group e times w[e]^T, groups ending at d.offsets."""
    dt = autocast_dtype(x)
    return torch._grouped_mm(x.to(dt), w.to(dt).transpose(-2, -1), offs=d.offsets)


def _looped(x: torch.Tensor, w: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """The per-expert loop (one host sync for the counts): the benchmark's baseline."""
    ends = d.offsets.tolist()
    parts, start = [], 0
    for e, end in enumerate(ends):
        parts.append(F.linear(x[start:end], w[e]))
        start = end
    out = torch.cat(parts)
    return torch.cat([out, out.new_zeros(x.shape[0] - end, out.shape[-1])])
