"""Checks of the model fields that today's Hugging Face families add (Qwen2's q/k/v biases,
Qwen3's q/k norms and head size, Llama 3's RoPE scaling, Mistral's window)."""

from __future__ import annotations

from shardtrain.config.errors import ConfigError

ROPE_SCALINGS = ("none", "llama3", "linear", "dynamic", "yarn")


def check_families(model) -> None:
    """model: ModelConfig (not imported: schema.py imports this module)."""
    pieces = [n for n in ("qkv_bias", "qk_norm") if getattr(model, n)]
    if model.rope_scaling != "none":
        pieces.append("rope_scaling")
    if model.style != "llama" and pieces:
        raise ConfigError(f"model.{pieces[0]} belongs to the llama style (Llama, Qwen, "
                          f"Mistral); model.style={model.style!r} has none: drop it")
    if model.head_size < 0 or model.sliding_window < 0:
        raise ConfigError("model.head_size and model.sliding_window must be >= 0 (0: "
                          "dim / n_heads, and no window)")
    if model.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"model.rope_scaling={model.rope_scaling!r} is not one of "
                          f"{', '.join(ROPE_SCALINGS)}")
    if model.rope_scaling != "none" and model.rope_factor <= 0:
        raise ConfigError(f"model.rope_factor={model.rope_factor} must be positive")
    if model.rope_attention_factor < 0 or (model.rope_scaling == "yarn"
                                           and model.rope_original_max_len <= 0):
        raise ConfigError("model.rope_scaling=yarn needs model.rope_original_max_len > 0 and "
                          "model.rope_attention_factor >= 0 (0: 0.1 ln(factor) + 1)")
    if model.rope_scaling == "llama3" and not (
            0 < model.rope_low_freq_factor < model.rope_high_freq_factor
            and model.rope_original_max_len > 0):
        raise ConfigError("model.rope_scaling=llama3 needs 0 < model.rope_low_freq_factor "
                          "< model.rope_high_freq_factor and model.rope_original_max_len > 0")


def check_window(seq_len: int, model) -> None:
    """Mistral's attention window: full causal attention over train.seq_len tokens equals the
    windowed attention only when the sequence fits in the window."""
    if model.sliding_window and seq_len > model.sliding_window:
        raise ConfigError(f"train.seq_len={seq_len} exceeds model.sliding_window="
                          f"{model.sliding_window} (the model's attention window): shardtrain "
                          "attends over the whole sequence, which equals windowed attention "
                          f"only when it fits; set train.seq_len <= {model.sliding_window}")


def moe_family(cfg) -> str:
    """The Hugging Face family a mixture-of-experts or latent-attention `cfg` (ModelConfig)
    is written as, mixtral, qwen3_moe or deepseek_v3 (model/hf_moe.py), or a ConfigError
    saying why none holds it."""
    if cfg.attention == "mla":
        return _deepseek(cfg)
    why = [what for what, bad in (
        ("sigmoid scores", cfg.moe_score != "softmax"), ("the expert bias", cfg.moe_balance == "bias"),
        ("shared experts", cfg.moe_shared_experts), ("group-limited routing", cfg.moe_groups),
        ("q/k/v biases", cfg.qkv_bias), ("top-1 gates", cfg.moe_top_k == 1),
        ("the gpt2 style", cfg.style != "llama")) if bad]
    if why:
        raise ConfigError(f"a mixture-of-experts model with {', '.join(why)} has no Hugging "
                          f"Face family to export to (Mixtral and Qwen3-MoE route with "
                          "softmax top-k >= 2, renormalised, no shared experts; DeepSeek-V3, "
                          "which has them, has latent attention: model.attention='mla')")
    if cfg.qk_norm:
        return "qwen3_moe"
    if cfg.moe_first_dense or cfg.expert_hidden != cfg.ffn_hidden:
        raise ConfigError("model.moe_ffn_dim or model.moe_first_dense without model.qk_norm: "
                          "Mixtral has neither, Qwen3-MoE (which has them) has q/k norms; no "
                          "Hugging Face family holds this model")
    return "mixtral"


def _deepseek(cfg) -> str:
    """DeepSeek-V3 (transformers' deepseek_v3): latent attention, and where there are experts
    sigmoid top-k >= 2 routing renormalised, shared experts, groups of >= 2 experts (its
    group score sums a group's best two)."""
    moe = bool(cfg.n_experts)
    why = [what for what, bad in (
        ("softmax scores", moe and cfg.moe_score != "sigmoid"),
        ("no shared expert", moe and not cfg.moe_shared_experts),
        ("top-1 gates", moe and cfg.moe_top_k == 1),
        ("one-expert groups", moe and cfg.moe_groups and cfg.n_experts // cfg.moe_groups < 2))
        if bad]
    if why:
        raise ConfigError(f"a latent-attention model with {', '.join(why)} has no Hugging Face "
                          "family to export to (DeepSeek-V3 routes with sigmoid scores, top-k "
                          ">= 2 renormalised, beside shared experts)")
    return "deepseek_v3"
