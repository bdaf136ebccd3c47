"""config.json of the llama-style Hugging Face families, in and out: Llama (2, 3.x with
`llama3` RoPE scaling), Qwen2/2.5 (biases on q, k, v), Qwen3 (per-head q/k RMSNorm, an
explicit head_dim) and Mistral (a sliding attention window).

They share one block (pre-norm RMSNorm, SwiGLU MLP, rotate-half RoPE, grouped-query
attention); each family adds one piece, which `ModelConfig` holds as a field (qkv_bias,
qk_norm, head_size, rope_scaling, sliding_window). A window is kept as a limit only:
with every sequence inside it (config/families.py refuses a longer train.seq_len),
windowed attention is full causal attention.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.hf_moe import MOE_FAMILIES, moe_fields, moe_fields_from_hf
from shardtrain.model.positions import yarn_attention_factor

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", *MOE_FAMILIES)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")


def refuse(file: Path, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{file}: {key}={value!r} is not supported ({why})")


def family_config(raw: dict[str, Any], file: Path, get) -> ModelConfig:
    """The ModelConfig of a llama-family config.json; `get(key, kind, default)` reads a
    typed field (hf_names._get)."""
    family = raw["model_type"]
    dim, heads = get("hidden_size", int), get("num_attention_heads", int)
    if get("hidden_act", str, "silu") != "silu":
        raise refuse(file, "hidden_act", raw["hidden_act"], "these blocks use SwiGLU (silu)")
    if get("mlp_bias", bool, False):
        raise refuse(file, "mlp_bias", True, "the MLP linears have no biases")
    if get("attention_bias", bool, False):
        raise refuse(file, "attention_bias", True, f"a {family} with biases on all four "
                     "attention projections; shardtrain reads q/k/v biases as Qwen2 has them")
    head_dim = get("head_dim", int, None)
    if family == "deepseek_v3":  # its head_dim names the RoPE channels: latent attention's
        head_dim = dim // heads
    if head_dim is None:  # Qwen3's default is 128, the others' hidden_size / heads
        head_dim = 128 if family == "qwen3" else dim // heads
    window = 0
    if family in ("mistral", "mixtral"):
        window = get("sliding_window", int, None) or 0
    elif family in ("qwen2", "qwen3", "qwen3_moe") and get("use_sliding_window", bool, False):
        window = get("sliding_window", int, None) or 0
        types = raw.get("layer_types")  # Qwen windows only layers >= max_window_layers
        if isinstance(types, list) and "sliding_attention" not in types:
            window = 0
    theta, scaling = _rope(raw, file)
    return ModelConfig(
        style="llama", vocab_size=get("vocab_size", int), dim=dim,
        n_layers=get("num_hidden_layers", int), n_heads=heads,
        n_kv_heads=0 if family == "deepseek_v3" else get("num_key_value_heads", int, heads),
        ffn_dim=get("intermediate_size", int),
        max_seq_len=get("max_position_embeddings", int, 2048),
        tie_embeddings=get("tie_word_embeddings", bool, False),
        norm_eps=get("rms_norm_eps", float, 1e-6), rope_theta=theta,
        head_size=0 if head_dim * heads == dim else head_dim,
        qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=window, **scaling,
        **(moe_fields_from_hf(raw, file, get) if family in MOE_FAMILIES else {}))


def _rope(raw: dict[str, Any], file: Path) -> tuple[float, dict[str, Any]]:
    """rope_theta and the ModelConfig's scaling fields, from rope_parameters (transformers
    5) or rope_scaling (4.x)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{file}: field 'rope_parameters' must be a JSON object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise refuse(file, "rope_type", rope_type, "shardtrain implements rope_type "
                     f"{', '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(file, "partial_rotary_factor", rope["partial_rotary_factor"], "RoPE turns "
                     "every channel of a head: 1.0")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{file}: field 'rope_theta'={theta!r} must be a positive number")

    def number(key: str, default: Any = ...) -> float:
        value = rope.get(key, default)
        if value is ...:
            raise ConfigError(f"{file}: rope_parameters field {key!r} is missing (rope_type "
                              f"{rope_type!r} needs it)")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{file}: rope_parameters field {key!r}={value!r} must be a "
                              f"positive number (rope_type {rope_type!r} needs it)")
        return value

    max_pos = raw.get("max_position_embeddings", 2048)
    max_len = raw.get("original_max_position_embeddings", max_pos)  # transformers' default
    scaling: dict[str, Any] = {}
    if rope_type in ("linear", "dynamic"):
        scaling = dict(rope_scaling=rope_type, rope_factor=float(number("factor")))
    elif rope_type == "llama3":
        scaling = dict(rope_scaling="llama3", rope_factor=float(number("factor")),
                       rope_low_freq_factor=float(number("low_freq_factor", 1.0)),
                       rope_high_freq_factor=float(number("high_freq_factor", 4.0)),
                       rope_original_max_len=int(number("original_max_position_embeddings",
                                                        max_len)))
    elif rope_type == "yarn":
        scaling = _yarn(rope, file, number, max_len, max_pos)
    return float(theta), scaling


def _yarn(rope: dict[str, Any], file: Path, number, max_len: int, max_pos: int
          ) -> dict[str, Any]:
    """YaRN's fields as transformers reads them: factor (default max / original length),
    attention_factor (default from factor, or mscale / mscale_all_dim); the ramp's bounds
    are fixed at transformers' defaults."""
    for key, plain in (("beta_fast", 32), ("beta_slow", 1), ("truncate", True)):
        if rope.get(key) not in (None, plain):
            raise refuse(file, key, rope[key], f"yarn with {key}={plain!r} only")
    original = int(number("original_max_position_embeddings", max_len))
    factor = float(number("factor", max_pos / original))

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
    return dict(rope_scaling="yarn", rope_factor=factor, rope_original_max_len=original,
                rope_attention_factor=float(attention or mscale(1.0)))


def family_of(cfg: ModelConfig, base: dict[str, Any] | None) -> str:
    """The Hugging Face family a llama-style model is written as: the source checkpoint's,
    when it can hold the model's pieces, else the one each piece implies."""
    fits = {"llama": not (cfg.qkv_bias or cfg.qk_norm or cfg.sliding_window),
            "mistral": not (cfg.qkv_bias or cfg.qk_norm),
            "qwen2": cfg.qkv_bias and not cfg.qk_norm,
            "qwen3": cfg.qk_norm and not cfg.qkv_bias}
    source = (base or {}).get("model_type")
    if source in fits and fits[source]:
        return source
    for family in ("qwen3", "qwen2", "llama", "mistral"):
        if fits[family]:
            return family
    raise ConfigError("model.qkv_bias and model.qk_norm together: no Hugging Face family "
                      "holds both (Qwen2 has the biases, Qwen3 the norms); drop one")


def family_fields(cfg: ModelConfig, base: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json fields that describe a llama-style `cfg` (a MoE one: hf_moe.py)."""
    moe = cfg.n_experts or cfg.attention == "mla"  # hf_moe.py's families
    family = "mistral" if moe else family_of(cfg, base)  # the block's fields
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none"
                            else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_len,
                    attention_factor=yarn_attention_factor(cfg))
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    out = dict(architectures=[ARCHITECTURES[family]], model_type=family, hidden_act="silu",
               hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, rope_parameters=rope)
    if family in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if family == "llama":
        out.update(mlp_bias=False)
    if family == "mistral":
        out.update(sliding_window=cfg.sliding_window or None)
    if family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=bool(cfg.sliding_window),
                   sliding_window=cfg.sliding_window or None)
        if cfg.sliding_window and "max_window_layers" not in (base or {}):
            out.update(max_window_layers=0)  # every layer windowed
    if moe:
        out.pop("sliding_window")  # the family's own fields say it
        out.update(moe_fields(cfg))
    return out
