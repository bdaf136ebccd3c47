"""train.fp8's checks (quant/float8.py runs the recipe; docs/precision.md, "FP8"): what it
composes with, refused before any process starts, and run again by `parallelize` on the
resolved config (train.precision=auto is resolved from the device only then)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from shardtrain.config.errors import ConfigError

if TYPE_CHECKING:
    from shardtrain.config.schema import Config

MULTIPLE = 16  # CUDA's fp8 _scaled_mm takes dimensions that are multiples of 16
VALUES = ("none", "tensorwise", "rowwise")  # TrainConfig.fp8's (the planner's Layout.fp8)


def check_fp8(cfg: Config) -> None:
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if t.fp8 not in VALUES:  # the TOML parser checks it; a planner Layout reaches here as is
        raise ConfigError(f"train.fp8={t.fp8!r} is not one of {', '.join(VALUES)}")
    if t.fp8 == "none":
        return
    head = f"train.fp8={t.fp8}"
    if t.precision not in ("bf16", "fp32", "auto"):  # torchao's recipes scale the gradients
        # themselves, for bf16 mixed precision; the 16-bit-parameter precisions are untried
        raise ConfigError(f"{head} with train.precision={t.precision}: fp8 training composes "
                          "with bf16 mixed precision (or fp32); set --train.precision bf16")
    if m.n_experts:
        raise ConfigError(f"{head} with model.n_experts={m.n_experts}: the experts' stacked "
                          "weights are not nn.Linear layers torchao converts; drop train.fp8 "
                          "or use a dense model (model.n_experts=0)")
    refused = [  # (field = value, set, why)
        (f"parallel.tp={p.tp}", p.tp > 1, "its column- and row-parallel linears are not "
         "converted, and a sharded weight's scale would need the amax agreed over tp"),
        (f"parallel.ps_servers={p.ps_servers}", p.ps_servers > 0,
         "fp8 has no parity row with parameter servers yet"),
        ("parallel.zero_quantized_weights=true", p.zero_quantized_weights,
         "ZeRO++'s int8 gathers would quantize the weights twice"),
        (f"lora.rank={cfg.lora.rank}", cfg.lora.rank > 0,
         "LoRA's frozen bases and adapters are not converted")]
    for field, bad, why in refused:
        if bad:
            raise ConfigError(f"{head} with {field}: {why}; drop train.fp8 or that setting")
    dims = {"model.dim": m.dim, "the q heads' width (model.n_heads x head dim)":
            m.n_heads * m.head_dim, "the kv heads' width": m.kv_heads * m.head_dim,
            "the MLP's hidden width": m.ffn_hidden}
    if m.attention == "mla":  # latent attention's linears' widths (model/mla.py)
        dims = {"model.dim": m.dim, "the MLP's hidden width": m.ffn_hidden,
                "model.n_heads x (qk_nope_head_dim + qk_rope_head_dim)": m.n_heads * m.qk_head_dim,
                "model.kv_lora_rank": m.kv_lora_rank,
                "model.kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim,
                "model.n_heads x (qk_nope_head_dim + v_head_dim)":
                    m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                "model.n_heads x v_head_dim": m.n_heads * m.v_head_dim,
                **({"model.q_lora_rank": m.q_lora_rank} if m.q_lora_rank else {})}
    for name, size in dims.items():
        if size % MULTIPLE:
            raise ConfigError(f"{head}: {name} = {size} is not a multiple of {MULTIPLE}, "
                              "which fp8 matrix multiplies need on CUDA; choose model.dim, "
                              "model.n_heads and model.ffn_dim to make it one")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{head} needs torchao (the fp8 extra): pip install "
                          "'shardtrain[fp8]', or drop train.fp8")

