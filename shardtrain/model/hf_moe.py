"""The mixture-of-experts Hugging Face families, in and out: Mixtral and Qwen3-MoE.

Both are the llama-style block (hf_families.py: Mixtral's attention is Mistral's, Qwen3-MoE's
Qwen3's) with the MLP replaced by a softmax top-k router over E SwiGLU experts whose k gates
are renormalised to sum to 1: shardtrain's `moe_score = softmax` routing (model/moe.py).
Qwen3-MoE's experts have their own width (`moe_intermediate_size`: model.moe_ffn_dim) and
may leave its first blocks dense (`mlp_only_layers` = 0..k-1: model.moe_first_dense).

Checkpoints store each expert's three projections as tensors of their own; shardtrain
stacks them per projection ([E, out, in]), so E Hugging Face tensors fill one of ours
(`TensorMap.expert`: the slice each one is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.config.families import moe_family

MOE_FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # config/families.py
# where the block's MoE lives in each family's checkpoint, and its experts' projection names
# in the order of ours (w1 gate, w3 up, w2 down)
LAYOUT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def moe_fields_from_hf(raw: dict[str, Any], file: Path, get) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral or Qwen3-MoE config.json (`get` as in
    hf_families.family_config); errors name what shardtrain does not run."""
    family = raw["model_type"]
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
