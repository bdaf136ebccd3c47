"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434 sec. 2.1; DeepSeek-V3,
arXiv 2412.19437 sec. 2.1.1), `model.attention = mla`.

Keys and values come from one small latent per token instead of per-head projections of
the input: x -> [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)] (`wkv_a`), c_kv through an
RMSNorm, then up to every head's k_nope (qk_nope_head_dim) and v (v_head_dim) (`wkv_b`).
RoPE is decoupled: it turns only k_pe, one key shared by all heads, and the last
qk_rope_head_dim channels of each query head; the nope channels carry no position. The
query goes through a bottleneck of its own where model.q_lora_rank > 0 (x -> c_q ->
RMSNorm -> heads, `wq_a`, `wq_b`), else one projection (`wq`). Scores are scaled by
1/sqrt(qk_nope_head_dim + qk_rope_head_dim), SDPA's default for that head dim.

The attention core is the model's swappable `core` (model/attention.py's sdpa_core by
default; ring or Ulysses under context parallelism, a checkpointed one under selective
recomputation), called on the decompressed q, k, v with every head its own key: no grouped
kv heads. The core takes one head dim for q, k and v (CUDA's flash kernel requires it, and
the cp cores send k and v as one packed buffer), so where v_head_dim is smaller than the
q/k head dim, v is zero-padded up to it and the output's padded channels (zeros) dropped:
exact, at (qk - v) / (2 qk) more K/V bytes (DeepSeek-V3's 192 and 128: 1/6).

The latent norms use eps 1e-6 whatever model.norm_eps is, as DeepSeek's reference code
and transformers' deepseek_v3 do. The model reads its head count from the up-projections'
shapes, so tensor parallelism may split them by heads (parallel/tensor/mla.py).
Shape legend: B batch, S sequence, H heads, R kv_lora_rank, Dn nope, Dr rope, Dv value,
D = Dn + Dr, C model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.config import ModelConfig
from shardtrain.model.attention import sdpa_core
from shardtrain.model.positions import Documents, apply_rope

LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """The MLA counterpart of transformer.Attention: the same call, the same `core`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        d, heads = cfg.qk_head_dim, cfg.n_heads
        if cfg.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * d, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * d, bias=False)
            self.wq_a = self.q_a_norm = self.wq_b = None
        self.wkv_a = nn.Linear(cfg.dim, self.rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.core = sdpa_core

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.nope + self.rope
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(b, s, -1, d).split([self.nope, self.rope], -1)  # [B, S, H, Dn|Dr]
        latent, k_pe = self.wkv_a(x).split([self.rank, self.rope], -1)  # [B, S, R], [B, S, Dr]
        kv = self.wkv_b(self.kv_a_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)  # [B, S, H, Dn], [B, S, H, Dv]
        k_pe = k_pe.unsqueeze(2)  # [B, S, 1, Dr]: one key for every head
        if rope is not None:
            q_pe, k_pe = apply_rope(q_pe, *rope), apply_rope(k_pe, *rope)
        heads = q_nope.shape[2]
        q = torch.cat([q_nope, q_pe], -1)  # [B, S, H, D]
        k = torch.cat([k_nope, k_pe.expand(b, s, heads, self.rope)], -1)  # [B, S, H, D]
        if self.v_dim < d:  # one head dim for the core (module docstring)
            v = F.pad(v, (0, d - self.v_dim))  # [B, S, H, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        out = out[..., :self.v_dim]  # [B, H, S, Dv]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # [B, S, C]
