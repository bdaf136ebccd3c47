"""The `[lora]` section: low-rank adapters on frozen linears, optionally over an NF4 base
(train/finetune/lora.py, quant/nf4.py). rank = 0 turns LoRA off (the whole model trains)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardtrain.config.errors import ConfigError

# Hugging Face projection names (peft's target_modules without the _proj) -> shardtrain's.
TARGET_MODULES = {"q": "attn.wq", "k": "attn.wk", "v": "attn.wv", "o": "attn.wo",
                  "gate": "mlp.w1", "up": "mlp.w3", "down": "mlp.w2"}


@dataclass(kw_only=True)
class LoRAConfig:
    """rank r and alpha: the update is (alpha / r) B A. targets: comma-separated among
    q, k, v, o, gate, up, down. quantize_base: nf4 stores the frozen target weights in
    4 bits (QLoRA). init_from: adapters to start from (peft's format)."""

    rank: int = 0
    alpha: float = 16.0
    targets: str = "q,k,v,o"
    dropout: float = 0.0
    quantize_base: Literal["none", "nf4"] = "none"
    # A peft adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    # training: its r, lora_alpha and target_modules set rank, alpha and targets
    # (train/finetune/peft_format.py); model.init_from is its base.
    init_from: str = ""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        if not self.enabled:
            if self.quantize_base != "none":
                raise ConfigError("lora.quantize_base=nf4 quantizes the frozen base under "
                                  "LoRA adapters: set lora.rank > 0 (e.g. 8)")
            return
        if self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.alpha={self.alpha} must be positive and lora.dropout="
                              f"{self.dropout} in [0, 1)")
        bad = [t for t in self.target_list if t not in TARGET_MODULES]
        if bad or not self.target_list:
            raise ConfigError(f"lora.targets={self.targets!r}: {bad[0] if bad else 'empty'!r} "
                              f"is not a target; choose among {', '.join(TARGET_MODULES)} "
                              "(comma-separated)")


def check_finetune_layout(cfg) -> None:
    """The layouts LoRA and the 8-bit optimizer compose with in this release (cfg: Config)."""
    p = cfg.parallel
    attention = [t for t in cfg.lora.target_list if t in ("q", "k", "v", "o")]
    if cfg.lora.enabled and cfg.model.attention == "mla" and attention:
        raise ConfigError(f"lora.targets={cfg.lora.targets!r}: latent attention "
                          "(model.attention='mla', model/mla.py) has no adapters on its "
                          "projections; target gate, up, down only")
    if cfg.lora.enabled:
        for name, value, why in (
                ("tp", p.tp if cfg.lora.quantize_base == "nf4" else 1, "an NF4 base is not "
                 "split with the tensor-parallel linears (lora.quantize_base=none is)"),
                ("zero", 0 if p.zero < 3 else p.zero, "ZeRO-3 gathers units of trainable "
                 "parameters by block and the frozen base has none; use parallel.zero=2")):
            if value > 1:
                raise ConfigError(f"lora.rank={cfg.lora.rank} with parallel.{name}={value}: "
                                  f"{why}; LoRA composes with data, tensor and pipeline "
                                  "parallelism and ZeRO-1/2")
    if cfg.optim.name == "adamw8bit" and p.offload != "none":
        raise ConfigError("optim.name=adamw8bit keeps its 8-bit moments beside the model; "
                          f"parallel.offload={p.offload} moves fp32 AdamW state: set "
                          "parallel.offload=none or optim.name=adamw")
