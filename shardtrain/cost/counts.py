"""Closed-form parameter and FLOP counts of a ModelConfig (pure arithmetic, no torch).

Conventions (see FORMULAS.md): a FLOP is one multiply or one add, so a matmul of
[m, k] x [k, n] costs 2mkn. Model FLOPs count forward + backward (3x forward) of every
matmul, attention scores included without halving for the causal mask, as Narayanan et
al. 2021 and Korthikanti et al. 2022 do; hardware FLOPs add the recomputed forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    total: int  # == sum(p.numel()) of the built model
    embedding: int  # token (+ position) embedding; the head too when untied
    per_layer: int  # the largest transformer block (a MoE block: all its experts)
    active_per_layer: int  # that block as one token sees it (top-k experts)
    active: int  # parameters one token touches
    dense_layer: int = 0  # a dense block (model.moe_first_dense), == per_layer when all are

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def mlp_params(cfg: ModelConfig, hidden: int | None = None) -> int:
    """One MLP of hidden width `hidden` (default ffn_hidden; the experts': expert_hidden)."""
    h, f = cfg.dim, hidden or cfg.ffn_hidden
    if cfg.style == "llama":
        return 3 * h * f
    return 2 * h * f + f + h  # two linears with biases


def expert_params(cfg: ModelConfig) -> int:
    """One routed expert."""
    return mlp_params(cfg, cfg.expert_hidden)


def shared_params(cfg: ModelConfig) -> int:
    """A MoE block's shared experts: one MLP of moe_shared_experts x the expert width."""
    n = cfg.moe_shared_experts
    return mlp_params(cfg, n * cfg.expert_hidden) if n else 0


def attention_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The attention's linears, name -> (out, in) features, in module order. mla (model/
    mla.py): the q bottleneck or one q projection, the kv latent with the shared RoPE key,
    its per-head up-projection to k_nope and v, and wo."""
    h, heads = cfg.dim, cfg.n_heads
    if cfg.attention != "mla":
        q, kv = heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q)}
    q = heads * cfg.qk_head_dim
    out = {"wq_a": (cfg.q_lora_rank, h), "wq_b": (q, cfg.q_lora_rank)} if cfg.q_lora_rank \
        else {"wq": (q, h)}
    return {**out, "wkv_a": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            "wkv_b": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            "wo": (h, heads * cfg.v_head_dim)}


def attention_matmul_params(cfg: ModelConfig) -> int:
    """The attention's linear weights (what one token multiplies by)."""
    return sum(o * i for o, i in attention_linears(cfg).values())


def latent_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, of them norms) of one block's attention that every tensor-parallel
    rank holds whole: mla's down-projections to its latents (wq_a, wkv_a) and the latents'
    RMSNorms (parallel/tensor/latent.py); none under mha."""
    if cfg.attention != "mla":
        return 0, 0
    norms = cfg.q_lora_rank + cfg.kv_lora_rank
    return cfg.dim * (norms + cfg.qk_rope_head_dim) + norms, norms


def attention_params(cfg: ModelConfig) -> int:
    if cfg.attention == "mla":  # the linears and the latent RMSNorms' weights
        return attention_matmul_params(cfg) + cfg.q_lora_rank + cfg.kv_lora_rank
    h, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    weights = h * q + 2 * h * kv + q * h
    biases = q + 2 * kv + h if cfg.style == "gpt2" else 0
    biases += q + 2 * kv if cfg.qkv_bias else 0  # Qwen2: q, k, v only
    norms = 2 * cfg.head_dim if cfg.qk_norm else 0  # Qwen3: one [D] weight each for q and k
    return weights + biases + norms


def norm_params(cfg: ModelConfig) -> int:
    return cfg.dim if cfg.style == "llama" else 2 * cfg.dim  # RMSNorm weight; LayerNorm w + b


def mtp_params(cfg: ModelConfig) -> int:
    """The multi-token prediction modules (model/mtp.py): per depth the two input norms,
    the projection [C, 2C], a dense block and the output norm (embedding and head shared)."""
    block = attention_params(cfg) + 2 * norm_params(cfg) + mlp_params(cfg)
    return cfg.mtp_depth * (3 * norm_params(cfg) + 2 * cfg.dim * cfg.dim + block)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h, v = cfg.dim, cfg.vocab_size
    dense = attention_params(cfg) + 2 * norm_params(cfg) + mlp_params(cfg)
    layer = active_layer = dense
    if cfg.n_experts:
        router = h * cfg.n_experts
        layer = attention_params(cfg) + 2 * norm_params(cfg) + router + shared_params(cfg) \
            + cfg.n_experts * expert_params(cfg)
        active_layer = layer - (cfg.n_experts - cfg.moe_top_k) * expert_params(cfg)
    moe, plain = cfg.moe_layers, cfg.n_layers - cfg.moe_layers
    if not moe:
        moe, plain = cfg.n_layers, 0
    embedding = v * h + (cfg.max_seq_len * h if cfg.style == "gpt2" else 0)
    head = 0 if cfg.tie_embeddings else v * h
    outside = embedding + head + norm_params(cfg) + mtp_params(cfg)
    return ParamCounts(total=moe * layer + plain * dense + outside, embedding=embedding + head,
                       per_layer=max(layer, dense), active_per_layer=active_layer,
                       active=moe * active_layer + plain * dense + outside, dense_layer=dense)


def kept_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(dense per block, expert per block, outside the blocks) parameters autocast does not
    round to the compute dtype (cost/units.py `rounded_for_compute`: norms, biases, the
    router, the embedding tables): what ZeRO-3 still gathers in fp32 under bf16 or fp16.
    For a MoE model, of a MoE block. Outside: the token (and position) table, the final
    norm (an untied head is rounded; a tied one is the token table), the MTP modules'."""
    h = cfg.dim
    attention = attention_params(cfg) - attention_matmul_params(cfg)  # biases, norms

    def biases(f: int) -> int:  # of one MLP of hidden width f
        return (f + h) if cfg.style == "gpt2" else 0

    block = 2 * norm_params(cfg) + attention
    expert = 0
    if cfg.n_experts:
        block += h * cfg.n_experts  # the router
        block += biases(cfg.moe_shared_experts * cfg.expert_hidden) if cfg.moe_shared_experts \
            else 0
        expert = cfg.n_experts * biases(cfg.expert_hidden)
    else:
        block += biases(cfg.ffn_hidden)
    outside = cfg.vocab_size * h + (cfg.max_seq_len * h if cfg.style == "gpt2" else 0)
    # the MTP modules' three norms per depth and their dense blocks' norms and biases
    mtp = cfg.mtp_depth * (3 * norm_params(cfg) + 2 * norm_params(cfg) + attention
                           + biases(cfg.ffn_hidden))
    return block, expert, outside + norm_params(cfg) + mtp


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies by: every active linear and the output head (embedding
    lookups, norms and biases are not matmuls)."""
    h = cfg.dim
    per = 3 if cfg.style == "llama" else 2  # the MLP's linears, each h x f
    attention = attention_matmul_params(cfg)
    dense = attention + per * h * cfg.ffn_hidden
    moe = attention + h * cfg.n_experts + per * h * cfg.expert_hidden * (
        cfg.moe_top_k + cfg.moe_shared_experts)  # routed k, shared, the router
    # each MTP depth: its projection [C, 2C], a dense block and the shared head once more
    mtp = cfg.mtp_depth * (2 * h * h + dense + cfg.vocab_size * h)
    return cfg.moe_layers * moe + (cfg.n_layers - cfg.moe_layers) * dense \
        + cfg.vocab_size * h + mtp


def core_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(H x q/k head dim, H x v head dim): per token and key, QK^T's and the weighted sum
    of V's multiply-adds. mla: the model's v_head_dim (the core's zero-padding of v,
    model/mla.py, is not model work)."""
    v = cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    return cfg.n_heads * cfg.qk_head_dim, cfg.n_heads * v


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """2 x matmul weights + attention scores and weighted values (2 x s x (q + v) per
    attention block, q = v = H x head dim under mha)."""
    return (2.0 * matmul_params_per_token(cfg)
            + 2.0 * attention_blocks(cfg) * seq_len * sum(core_widths(cfg)))


def attention_blocks(cfg: ModelConfig) -> int:
    """Blocks whose attention runs per token: the layers and one per MTP depth."""
    return cfg.n_layers + cfg.mtp_depth


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward, no recomputation. For GPT-3-like shapes this equals
    72 B s L h^2 (1 + s/(6h) + V/(12hL)) / (B s) of Narayanan et al. 2021 (eq. 3)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                             attention: str = "flash") -> float:
    """Model FLOPs plus what the runtime's recomputation redoes (Korthikanti et al. 2022,
    section 5), as torch.utils.checkpoint runs it: non-reentrant with early stop, so a
    recomputation ends once every tensor backward needs is rebuilt, and an op whose output
    nothing saves is not rerun.
    - selective (parallel/activation.checkpoint_attention_cores): the attention core's
      forward, 4 s^2 h per layer and sequence (QK^T and the weighted sum of V; the causal
      mask not halving it, as everywhere here) with the flash kernel, one op whose out and
      logsumexp backward needs; with the math kernel only QK^T and the softmax rerun (the
      product with V is saved by nothing): 2 s^2 h.
    - full: every block's forward except its last matmul (the dense MLP's w2, whose input
      is saved and whose output is not): 2 h f per token and layer less than a whole
      forward. For GPT-3-like shapes Korthikanti's 96 B s L h^2 (1 + s/(6h) + V/(16Lh))
      less 8 B s L h^2 (closed_form.py keeps the paper's forms; the selective one
      charges 12 s^2 h)."""
    base = model_flops_per_token(cfg, seq_len)
    if recompute == "none":
        return base
    if recompute == "selective":
        return base + attention_core_flops_per_token(cfg, seq_len, recompute, attention) \
            - attention_core_flops_per_token(cfg, seq_len)
    if recompute == "full":
        # a MoE block's last matmul is its shared experts' w2 where it has them
        dense = cfg.n_layers - cfg.moe_layers
        last = 2.0 * cfg.dim * (dense * cfg.ffn_hidden + cfg.moe_layers
                                * cfg.moe_shared_experts * cfg.expert_hidden)
        # not rerun either: the heads (the main one, each MTP depth's) and MTP projections
        outside = 2.0 * cfg.dim * ((1 + cfg.mtp_depth) * cfg.vocab_size
                                   + cfg.mtp_depth * (2 * cfg.dim + cfg.ffn_hidden))
        return base + forward_flops_per_token(cfg, seq_len) - outside - last
    raise ValueError(f"recompute={recompute!r} is not one of none, selective, full")


def attention_core_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none",
                                   attention: str = "flash") -> float:
    """The attention core's share of `hardware_flops_per_token`: QK^T and the weighted sum
    of V, 2 s (q + v) per attention block forward (`core_widths`), three passes, plus what
    recomputation reruns of it (full and flash-selective: its forward; math-selective:
    QK^T only). The rest is the linears'."""
    qk, av = (2.0 * attention_blocks(cfg) * seq_len * w for w in core_widths(cfg))
    rerun = {"none": 0.0, "full": qk + av, "selective": qk + av if attention != "math" else qk}
    return (qk + av) * 3.0 + rerun[recompute]
