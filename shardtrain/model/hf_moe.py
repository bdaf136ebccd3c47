"""The mixture-of-experts Hugging Face families, in and out: Mixtral, Qwen3-MoE and
DeepSeek-V3.

Both are the llama-style block (hf_families.py: Mixtral's attention is Mistral's, Qwen3-MoE's
Qwen3's) with the MLP replaced by a softmax top-k router over E SwiGLU experts whose k gates
are renormalised to sum to 1: shardtrain's `moe_score = softmax` routing (model/moe.py).
Qwen3-MoE's experts have their own width (`moe_intermediate_size`: model.moe_ffn_dim) and
may leave its first blocks dense (`mlp_only_layers` = 0..k-1: model.moe_first_dense).

DeepSeek-V3 (transformers' deepseek_v3; arXiv 2412.19437) is the llama-style block with
latent attention (model.attention = mla) and DeepSeek's MoE: sigmoid scores, the router's
e_score_correction_bias (our expert bias, moe_balance = bias), shared experts, the first
first_k_dense_replace blocks dense, group-limited routing (n_group / topk_group:
moe_groups / moe_max_groups) and routed_scaling_factor (moe_route_scale). Its multi-token
prediction modules (num_nextn_predict_layers, stored as the blocks after the last) are not
in transformers' model: loading skips them (hf.py), export writes none and says 0.

Checkpoints store each expert's three projections as tensors of their own; shardtrain
stacks them per projection ([E, out, in]), so E Hugging Face tensors fill one of ours
(`TensorMap.expert`: the slice each one is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.config.families import moe_family

MOE_FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM"}  # config/families.py
# where the block's MoE lives in each family's checkpoint, and its experts' projection names
# in the order of ours (w1 gate, w3 up, w2 down)
LAYOUT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def moe_fields_from_hf(raw: dict[str, Any], file: Path, get) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral or Qwen3-MoE config.json (`get` as in
    hf_families.family_config); errors name what shardtrain does not run."""
    family = raw["model_type"]
    if family == "deepseek_v3":
        return _deepseek_from_hf(raw, file, get)
    experts = get("num_local_experts", int, None) or get("num_experts", int)
    if get("router_jitter_noise", float, 0.0):
        raise ConfigError(f"{file}: router_jitter_noise={raw['router_jitter_noise']!r} is not "
                          "supported (the router takes no input noise); set it to 0")
    fields = dict(n_experts=experts, moe_top_k=get("num_experts_per_tok", int),
                  moe_aux_loss_coef=get("router_aux_loss_coef", float, 0.001),
                  moe_z_loss_coef=0.0)
    if family == "qwen3_moe":
        if not get("norm_topk_prob", bool, False):
            raise ConfigError(f"{file}: norm_topk_prob=false is not supported (shardtrain "
                              "renormalises the k gates to sum to 1, as norm_topk_prob=true)")
        n, step = get("num_hidden_layers", int), get("decoder_sparse_step", int, 1)
        dense = sorted(raw.get("mlp_only_layers") or [])
        if step != 1 or dense != list(range(len(dense))) or len(dense) >= n:
            raise ConfigError(f"{file}: decoder_sparse_step={step} with mlp_only_layers="
                              f"{dense} is not supported: shardtrain's dense blocks are the "
                              "first k (model.moe_first_dense), the rest all MoE")
        fields.update(moe_ffn_dim=get("moe_intermediate_size", int), moe_first_dense=len(dense))
    return fields


def moe_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a MoE `cfg` beyond the block's (hf_families.family_fields)."""
    family = moe_family(cfg)
    if family == "deepseek_v3":
        return _deepseek_fields(cfg)
    out = dict(architectures=[MOE_FAMILIES[family]], model_type=family,
               num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
               router_aux_loss_coef=cfg.moe_aux_loss_coef, output_router_logits=False)
    if family == "mixtral":
        out.update(intermediate_size=cfg.expert_hidden, router_jitter_noise=0.0,
                   sliding_window=cfg.sliding_window or None)
    else:
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.expert_hidden,
                   intermediate_size=cfg.ffn_hidden, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=list(range(cfg.moe_first_dense)),
                   attention_bias=False, use_sliding_window=bool(cfg.sliding_window),
                   sliding_window=cfg.sliding_window or None)
    return out


def _deepseek_from_hf(raw: dict[str, Any], file: Path, get) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V3 config.json beyond the block's: its latent
    attention, and its experts unless first_k_dense_replace leaves every block dense."""
    heads = get("num_attention_heads", int)
    for key, value, plain, why in (
            ("num_key_value_heads", get("num_key_value_heads", int, heads), heads,
             "latent attention gives every head its own keys"),
            ("rope_interleave", get("rope_interleave", bool, True), True, "shardtrain's RoPE "
             "turns the interleaved channel pairs DeepSeek's weights are laid out for")):
        if value != plain:
            raise ConfigError(f"{file}: {key}={value!r} is not supported ({why})")
    fields = dict(attention="mla", q_lora_rank=get("q_lora_rank", int, None) or 0,
                  kv_lora_rank=get("kv_lora_rank", int),
                  qk_nope_head_dim=get("qk_nope_head_dim", int),
                  qk_rope_head_dim=get("qk_rope_head_dim", int),
                  v_head_dim=get("v_head_dim", int))
    dense = get("first_k_dense_replace", int, 0)
    if dense >= get("num_hidden_layers", int):
        return fields
    if not get("norm_topk_prob", bool, True) or get("num_experts_per_tok", int) < 2:
        raise ConfigError(f"{file}: norm_topk_prob=false or num_experts_per_tok=1 is not "
                          "supported (shardtrain renormalises k >= 2 sigmoid gates)")
    groups, limit = get("n_group", int, 1), get("topk_group", int, 1)
    fields.update(
        n_experts=get("n_routed_experts", int), moe_top_k=get("num_experts_per_tok", int),
        moe_ffn_dim=get("moe_intermediate_size", int),
        moe_shared_experts=get("n_shared_experts", int), moe_first_dense=dense,
        moe_score="sigmoid", moe_balance="bias", moe_z_loss_coef=0.0,
        moe_aux_loss_coef=get("aux_loss_alpha", float, 0.0001),  # the sequence-wise loss
        moe_route_scale=get("routed_scaling_factor", float, 1.0),
        moe_groups=groups if groups > 1 else 0, moe_max_groups=limit if groups > 1 else 0)
    if not fields["moe_shared_experts"]:
        raise ConfigError(f"{file}: n_shared_experts=0 is not supported (transformers' "
                          "DeepSeek-V3 block always has its shared MLP)")
    return fields


def _deepseek_fields(cfg: ModelConfig) -> dict[str, Any]:
    """A DeepSeek-V3 config.json's own fields for `cfg` (moe_family said it fits). A dense
    model is every block dense (first_k_dense_replace = the block count); the expert fields
    then keep shapes transformers builds nothing from."""
    out = dict(architectures=[MOE_FAMILIES["deepseek_v3"]], model_type="deepseek_v3",
               num_key_value_heads=cfg.n_heads, head_dim=cfg.qk_rope_head_dim,
               q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
               qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
               v_head_dim=cfg.v_head_dim, rope_interleave=True, attention_bias=False,
               num_nextn_predict_layers=0, first_k_dense_replace=cfg.n_layers)
    if cfg.n_experts:
        out.update(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                   moe_intermediate_size=cfg.expert_hidden,
                   n_shared_experts=cfg.moe_shared_experts,
                   first_k_dense_replace=cfg.moe_first_dense, norm_topk_prob=True,
                   routed_scaling_factor=cfg.moe_route_scale, aux_loss_alpha=cfg.moe_aux_loss_coef,
                   n_group=cfg.moe_groups or 1, topk_group=cfg.moe_max_groups or 1)
    return out
