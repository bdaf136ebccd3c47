"""The rules of 16-bit training without a master copy (train.precision = bf16-true |
fp16-true, parallel/true16.py) and of optim.bf16_update, checked before any process starts.

What they compose with: DP, ZeRO-1/2/3, TP/SP, PP, CP, EP and LoRA (docs/precision.md,
"16-bit training"). What they refuse, each for a reason the message names: the layouts and
optimizers whose design is an fp32 copy of the weights somewhere else."""

from __future__ import annotations

from typing import Any

from shardtrain.config.errors import ConfigError

TRUE16 = ("bf16-true", "fp16-true")  # the precisions whose parameters are 16-bit


def is_true16(precision: str) -> bool:
    return precision in TRUE16


def check_true_precision(cfg: Any) -> None:
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    if o.bf16_update != "nearest" and t.precision != "bf16-true":
        raise ConfigError(f"optim.bf16_update={o.bf16_update} rounds a bf16-true update into "
                          f"bf16 weights; train.precision={t.precision} "
                          + ("has fp16 weights (no bf16 rounding to correct)"
                             if t.precision == "fp16-true" else "keeps fp32 weights")
                          + ": set optim.bf16_update=nearest or train.precision=bf16-true")
    if not is_true16(t.precision):
        return
    why = f"train.precision={t.precision} keeps no fp32 copy of the weights"
    refused = [
        (p.ps_servers > 0, f"parallel.ps_servers={p.ps_servers}",
         "the servers' optimizer keeps fp32 weights", "parallel.ps_servers=0"),
        (p.offload != "none", f"parallel.offload={p.offload}",
         "ZeRO-Offload's host optimizer keeps fp32 master weights", "parallel.offload=none"),
        (o.name == "adamw8bit", "optim.name=adamw8bit",
         "its shards keep fp32 master weights beside the 8-bit moments", "optim.name=adamw"),
        (cfg.comm.compress == "topk", "comm.compress=topk",
         "its error feedback accumulates fp32 updates against fp32 weights",
         "comm.compress=none or int8"),
        (p.zero_quantized_weights, "parallel.zero_quantized_weights=true",
         "qwZ writes dequantized weights over the shard, which is the only copy here",
         "parallel.zero_quantized_weights=false"),
        (cfg.lora.quantize_base != "none", f"lora.quantize_base={cfg.lora.quantize_base}",
         "QLoRA computes its adapters against a dequantized base under autocast",
         "lora.quantize_base=none (the base is bf16 already) or train.precision=bf16"),
    ]
    for bad, field, reason, fix in refused:
        if bad:
            raise ConfigError(f"{field} with {why}: {reason}; set {fix}, or use "
                              f"train.precision={t.precision.removesuffix('-true')}")
