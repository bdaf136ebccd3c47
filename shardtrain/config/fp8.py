"""train.fp8's checks (quant/float8.py runs the recipe, quant/float8_tp.py its
tensor-parallel form; docs/precision.md, "FP8"): what it composes with, refused before any
process starts, and run again by `parallelize` on the resolved config (train.precision=auto
is resolved from the device only then)."""

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
        # torchao 0.18's fp8 grouped matmul (prototype.moe_training) is rowwise only and
        # runs on CUDA alone (triton kernels and torch._scaled_grouped_mm)
        raise ConfigError(f"{head} with model.n_experts={m.n_experts}: the experts' stacked "
                          "weights are not nn.Linear layers torchao converts, and its fp8 "
                          "grouped matmul runs on CUDA only; drop train.fp8 or use a dense "
                          "model (model.n_experts=0)")
    refused = [  # (field = value, set, why)
        (f"parallel.tp={p.tp} above model.n_kv_heads={m.kv_heads}", p.tp > m.kv_heads,
         "tp ranks then share a kv head and each holds a part of its k and v projections' "
         "output gradient, whose fp8 cast would round the parts, not their sum; use "
         "parallel.tp <= model.n_kv_heads"),
        (f"parallel.tp={p.tp} with model.attention=mla", p.tp > 1 and m.attention == "mla",
         "the latents' down-projections are whole on every tp rank, and each rank holds the "
         "part of their output gradient its heads give, whose fp8 cast would round the "
         "parts, not their sum"),
        (f"parallel.ps_servers={p.ps_servers}", p.ps_servers > 0,
         "fp8 has no parity row with parameter servers yet"),
        ("parallel.zero_quantized_weights=true", p.zero_quantized_weights,
         "ZeRO++'s int8 gathers would quantize the weights twice"),
        (f"lora.rank={cfg.lora.rank}", cfg.lora.rank > 0,
         "LoRA's frozen bases and adapters are not converted")]
    for field, bad, why in refused:
        if bad:
            raise ConfigError(f"{head} with {field}: {why}; drop train.fp8 or that setting")
    # Every matmul dimension a rank sees: (size, parts) with parts the tp split; tensor
    # parallelism splits the heads' and the MLP's widths over tp (parallel/tensor/layers.py,
    # latent.py), never model.dim nor the latents (whole on every tp rank)
    split = f" / parallel.tp={p.tp}" if p.tp > 1 else ""
    t_ = p.tp
    dims = {"model.dim": (m.dim, 1), f"the MLP's hidden width{split}": (m.ffn_hidden, t_)}
    if m.attention == "mla":  # latent attention's linears' widths (model/mla.py)
        dims |= {f"model.n_heads x (qk_nope_head_dim + qk_rope_head_dim){split}":
                 (m.n_heads * m.qk_head_dim, t_),
                 "model.kv_lora_rank": (m.kv_lora_rank, 1),
                 "model.kv_lora_rank + qk_rope_head_dim":
                     (m.kv_lora_rank + m.qk_rope_head_dim, 1),
                 f"model.n_heads x (qk_nope_head_dim + v_head_dim){split}":
                     (m.n_heads * (m.qk_nope_head_dim + m.v_head_dim), t_),
                 f"model.n_heads x v_head_dim{split}": (m.n_heads * m.v_head_dim, t_),
                 **({"model.q_lora_rank": (m.q_lora_rank, 1)} if m.q_lora_rank else {})}
    else:
        dims |= {f"the q heads' width (model.n_heads x head dim){split}":
                 (m.n_heads * m.head_dim, t_),
                 f"the kv heads' width{split}": (m.kv_heads * m.head_dim, t_)}
    for name, (size, parts) in dims.items():
        if size % (MULTIPLE * parts):
            raise ConfigError(f"{head}: {name} = {size / parts:g} is not a multiple of "
                              f"{MULTIPLE}, which fp8 matrix multiplies need on CUDA; choose "
                              "model.dim, model.n_heads and model.ffn_dim (or parallel.tp) "
                              "to make it one")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{head} needs torchao (the fp8 extra): pip install "
                          "'shardtrain[fp8]', or drop train.fp8")

