"""LoRA and QLoRA: low-rank adapters on frozen linears (Hu et al. 2022, "LoRA: Low-Rank
Adaptation of Large Language Models"; Dettmers et al. 2023, "QLoRA").

A target linear y = W x + b becomes y = W x + b + (alpha / r) B A dropout(x), with
A [r, in] and B [out, r] the only trainable tensors. A starts Kaiming-uniform (the init
nn.Linear and peft give it), B at zero, so the adapted model starts equal to the base
model. Everything else in the model is frozen (requires_grad False: no gradient, no
optimizer state, nothing to reduce). With `quantize_base = "nf4"` the frozen W is kept as
NF4 (quant/nf4.py) and dequantized for each matmul.

Names stay those of the plain model (`layers.0.attn.wq.weight`), with the adapters beside
them (`layers.0.attn.wq.lora_a`, `...lora_b`), so a Hugging Face checkpoint loads into an
adapted model (model/hf.py calls `load_weight`, which quantizes on arrival) and a merged
export (`export_weight`) writes the plain names back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.config.lora import TARGET_MODULES, LoRAConfig
from shardtrain.model.transformer import init_tensor
from shardtrain.quant.nf4 import BLOCK as NF4_BLOCK
from shardtrain.quant.nf4 import NF4Weight, nf4_linear


class LoRALinear(nn.Module):
    """A frozen linear (dense or NF4) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        device = base.weight.device
        if cfg.quantize_base == "nf4":
            self.weight = None
            self.nf4 = NF4Weight((self.out_features, self.in_features), device=device)
            if device.type != "meta":
                self.nf4.quantize_(base.weight)
        else:
            self.weight = nn.Parameter(base.weight.detach(), requires_grad=False)
            self.nf4 = None
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(),
                                                                requires_grad=False)
        self.rank, self.scaling = cfg.rank, cfg.alpha / cfg.rank
        self.lora_a = nn.Parameter(torch.zeros(cfg.rank, self.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, cfg.rank, device=device))
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.merged = False

    @torch.no_grad()
    def reset_adapter(self, name: str, seed: int, cfg: ModelConfig) -> None:
        """A Kaiming-uniform, B zero: `init_tensor`'s rule for `name`.lora_a / .lora_b,
        drawn by (seed, name) so every layout draws the same."""
        for leaf in ("lora_a", "lora_b"):
            p = getattr(self, leaf)
            p.copy_(init_tensor(f"{name}.{leaf}", tuple(p.shape), seed, cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4 is not None:
            y = nf4_linear(x, self.nf4, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)  # [..., out]
        return y + update * self.scaling

    def delta(self) -> torch.Tensor:
        """The merged update scaling * B A [out, in]."""
        return (self.lora_b @ self.lora_a) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        if self.nf4 is not None:
            raise ValueError("an NF4 base cannot absorb the update; export_weight() gives the "
                             "merged dense weight")
        if not self.merged:
            self.weight.add_(self.delta().to(self.weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight.sub_(self.delta().to(self.weight.dtype))
            self.merged = False

    def base_weight(self) -> torch.Tensor:
        return self.nf4.dequantize() if self.nf4 is not None else self.weight.detach()

    @torch.no_grad()
    def export_weight(self) -> torch.Tensor:
        """The dense weight of the adapted layer: W + scaling B A."""
        w = self.base_weight().float()
        return w if self.merged else w + self.delta().float()

    @torch.no_grad()
    def load_weight(self, value: torch.Tensor) -> None:
        if self.nf4 is not None:
            self.nf4.quantize_(value)
        else:
            self.weight.copy_(value)


def target_suffixes(cfg: LoRAConfig) -> dict[str, str]:
    """Module-name suffix -> target name, e.g. "attn.wq" -> "q"."""
    return {module: target for target, module in TARGET_MODULES.items() if target in cfg.target_list}


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, seed: int) -> list[str]:
    """Freeze `model` and wrap its target linears in place; the wrapped module names.
    The model may be on the meta device (the adapters are then drawn by `reset_adapters`
    once it is materialised)."""
    wanted = target_suffixes(cfg)
    found: dict[str, list[str]] = {t: [] for t in wanted.values()}
    for name, module in list(model.named_modules()):
        suffix = ".".join(name.split(".")[-2:])
        if suffix in wanted and isinstance(module, nn.Linear):
            found[wanted[suffix]].append(name)
    for target, names in found.items():
        if not names:
            raise ConfigError(f"lora.targets includes {target!r}, but this model has no "
                              f"{TARGET_MODULES[target]} linear (a gpt2-style MLP has no up "
                              "projection: its two linears are 'gate' and 'down'); drop it")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = [n for names in found.values() for n in names]
    for name in wrapped:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, leaf)
        if cfg.quantize_base == "nf4" and base.weight.numel() % NF4_BLOCK:
            raise ConfigError(f"lora.quantize_base=nf4: {name} has {base.weight.numel()} "
                              f"weights, not a multiple of the NF4 block ({NF4_BLOCK}); use "
                              "quantize_base=none for this model")
        setattr(parent, leaf, LoRALinear(base, cfg))
    if any(p.device.type != "meta" for p in model.parameters()):
        reset_adapters(model, seed)
    return sorted(wrapped)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def reset_adapters(model: nn.Module, seed: int) -> None:
    for name, module in lora_modules(model).items():
        module.reset_adapter(name, seed, model.cfg)


def merge(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.merge()


def unmerge(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.unmerge()


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone: {module name + ".lora_a" | ".lora_b": tensor}."""
    return {f"{n}.{leaf}": getattr(m, leaf).detach().contiguous()
            for n, m in lora_modules(model).items() for leaf in ("lora_a", "lora_b")}
