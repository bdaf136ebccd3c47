"""The dense MLP of a block, and of a mixture of experts' shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU (llama: w2(silu(w1 x) * w3 x)) or GELU (gpt2: w2(gelu(w1 x))), of hidden
    width `hidden` (default: the config's ffn_hidden)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        bias, f = cfg.style == "gpt2", hidden or cfg.ffn_hidden
        self.gated = cfg.style == "llama"
        self.w1 = nn.Linear(cfg.dim, f, bias=bias)
        self.w3 = nn.Linear(cfg.dim, f, bias=False) if self.gated else None
        self.w2 = nn.Linear(f, cfg.dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
