"""A plain decoder-only transformer: Llama style or GPT-2 style, from one ModelConfig.

The model knows nothing about parallelism. Attention reads its head count from the
shapes of its projections, so a layout that shards heads can swap the linears without
touching this file. Shape legend: B batch, S sequence, H heads, G kv heads, D head dim,
C model width (dim), V vocabulary.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from shardtrain.config import ModelConfig
from shardtrain.model.attention import sdpa_core
from shardtrain.model.mla import LatentAttention
from shardtrain.model.mlp import MLP
from shardtrain.model.moe import MoE
from shardtrain.model.mtp import MTPModule, MTPOutput, depth_tokens, mtp_forward
from shardtrain.model.positions import (Documents, apply_rope, position_ids, position_index,
                                        rope_tables)


# (q, k, v) -> out; with packed documents (q, k, v, documents: model/positions.py)
AttentionCore = Callable[..., torch.Tensor]


class Attention(nn.Module):
    """Projections, RoPE and the attention core. `core` (q, k, v after RoPE -> output) is
    the one part a layout may replace: context parallelism swaps in ring or Ulysses
    attention, selective recomputation a checkpointed core (parallel/)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.style == "gpt2"
        qkv_bias = bias or cfg.qkv_bias  # Qwen2: biases on q, k, v, none on o
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)
        # Qwen3: RMSNorm over each head's D channels of q and k, before RoPE; one weight [D]
        # shared by every head, so a layout that splits heads keeps it whole.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core: AttentionCore = sdpa_core

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [B, S, H, D]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [B, S, G, D]
        v = self.wv(x).view(b, s, -1, self.head_dim)  # [B, S, G, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H|G, S, D]
        # The plain call without documents: a core (selective recomputation's checkpoint
        # included) is never handed a None it would have to pass on.
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        # out: [B, H, S, D]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # [B, S, C]


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.style == "llama":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); block `layer`'s
    mlp is a mixture of experts where the config says so (ModelConfig.is_moe), unless
    `dense` (the multi-token prediction modules' block: model/mtp.py); its attention latent
    under model.attention = mla (model/mla.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, *, dense: bool = False):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MoE(cfg, layer) if cfg.is_moe(layer) and not dense else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, documents)
        return x + self.mlp(self.mlp_norm(x))


def tied_names(cfg: ModelConfig) -> dict[str, str]:
    """The model's tied parameters, other name -> first name: one tensor, saved once under its
    first name, whichever rank or stage holds which of the names."""
    return {"head.weight": "tok_emb.weight"} if cfg.tie_embeddings else {}


class Transformer(nn.Module):
    """tokens [B, S] (and positions [B, S] for packed documents) -> logits [B, S, V]; with
    model.mtp_depth, in training, the main and the depths' logits (model/mtp.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.style == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = mtp_modules(cfg)
        self.tie_weights()
        # The global positions of the tokens this rank holds, when they are not 0..S-1
        # (context parallelism sets them: parallel/context/); None: the first S positions.
        self.positions: torch.Tensor | None = None
        if cfg.style == "llama":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        for name, first in tied_names(self.cfg).items():
            self.get_submodule(name.rpartition(".")[0]).weight = self.get_parameter(first)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *,
                mtp_tokens: torch.Tensor | None = None) -> torch.Tensor | MTPOutput:
        """`positions`: each token's position in its document, [B, S] (data.document_mask:
        attention stays inside documents; under context parallelism the full rows', not
        the tokens held); None: one sequence per row, causal. `mtp_tokens` [B, S, D]: the
        MTP depths' input tokens (model/mtp.py `depth_batch`; None: from `tokens`)."""
        documents = None if positions is None else Documents.from_positions(positions)
        x = self.tok_emb(tokens)  # [B, S, C]
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids(self, tokens.shape[1], positions, x.device,
                                              documents))
        else:
            at = position_index(self, tokens.shape[1], positions, documents)
            rope = (self.rope_cos[at], self.rope_sin[at])
        for layer in self.layers:
            x = layer(x, rope, documents)
        logits = self.head(self.norm(x))
        if self.mtp is None or not self.training:  # inference: the main model alone
            return logits
        if mtp_tokens is None:
            mtp_tokens = depth_tokens(tokens, self.cfg.mtp_depth)
        return mtp_forward(self, x, mtp_tokens, logits, rope, documents)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation, independent of device and of module order (see
        `init_tensor`), so a sharded layout can draw the same full tensor and keep its slice."""
        self.tie_weights()
        init_parameters(self, self.cfg, seed)

    def init_buffers(self) -> None:
        """The state a checkpoint does not hold, after `to_empty` (the weights then come from
        the checkpoint): tied weights and the RoPE tables."""
        self.tie_weights()
        init_state_buffers(self, self.cfg)


def mtp_modules(cfg: ModelConfig) -> nn.ModuleList | None:
    """The multi-token prediction modules (model/mtp.py), registered as `mtp.<k-1>` for
    depth k; None without them (the state dict is then unchanged)."""
    if not cfg.mtp_depth:
        return None
    return nn.ModuleList(MTPModule(cfg, block=Block(cfg, dense=True), norm=lambda: _norm(cfg))
                         for _ in range(cfg.mtp_depth))


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter of `module` (the model, or a part of it registered under the model's
    own names) by its full-model name, and the RoPE tables where the module has them."""
    for name, p in module.named_parameters():
        p.copy_(init_tensor(name, tuple(p.shape), seed, cfg))
    init_state_buffers(module, cfg)


@torch.no_grad()
def init_state_buffers(module: nn.Module, cfg: ModelConfig) -> None:
    """The buffers of a freshly materialised module: the RoPE tables where it has them,
    and the expert biases' starting zeros (model/moe.py; a checkpoint's values, where one
    is loaded, replace them later)."""
    for sub in module.modules():
        if isinstance(sub, MoE) and hasattr(sub, "expert_bias"):
            sub.expert_bias.zero_()
    if hasattr(module, "rope_cos"):
        cos, sin = rope_tables(cfg)
        module.rope_cos = cos.to(module.rope_cos.device)
        module.rope_sin = sin.to(module.rope_sin.device)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The initial value of parameter `name`, drawn on the CPU from a generator seeded by
    (seed, name): ones for norm weights, zeros for biases, N(0, 0.02) for weights, with the
    residual output projections (wo, w2) at 0.02 / sqrt(2 n_layers) (GPT-2's scaled init).
    Stacked expert weights ([E, out, in], model/moe.py) are drawn slice by slice
    (`init_expert`). LoRA adapters (train/finetune/lora.py): lora_a [r, in] Kaiming-uniform with
    a = sqrt(5) (bound 1/sqrt(in), as nn.Linear and peft draw it), lora_b zero, so step 0
    is the base model."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if "norm" in owner:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf in ("bias", "lora_b") or (owner == "experts" and leaf in ("b1", "b2")):
        return torch.zeros(shape)
    if owner == "experts":
        return torch.stack([init_expert(name, shape[1:], seed, cfg, e) for e in range(shape[0])])
    gen = _generator(seed, name)
    if leaf == "lora_a":
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    std = 0.02 / math.sqrt(2 * cfg.n_layers) if owner in ("wo", "w2") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def init_expert(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig,
                expert: int) -> torch.Tensor:
    """Slice `expert` [out, in] of the stacked expert weight `name` (w1, w3 at 0.02; w2, the
    residual output, at 0.02 / sqrt(2 n_layers)), drawn from (seed, name, expert) alone: an
    expert-parallel rank holding experts [a, b) draws exactly its slices, e in range(a, b)."""
    std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(".w2") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, f"{name}#{expert}"))


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def build_model(cfg: ModelConfig, *, device: str | torch.device = "cpu",
                seed: int | None = 0) -> Transformer:
    """Build on the meta device, then materialise on `device` and initialise (seed=None
    leaves it on meta: shapes only, for planning models that do not fit anywhere)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if seed is None:
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
