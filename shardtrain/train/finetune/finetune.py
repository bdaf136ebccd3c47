"""Fine-tuning set-up: the model a run starts from (fresh, or a Hugging Face directory's
weights via `model.init_from`), LoRA/QLoRA applied, and the exports at the end (a merged
Hugging Face directory, or the adapters alone).

`resolve_init_from` is the one place where a config meets a Hugging Face config.json: the
shape fields come from it, and a field the user set to something else is an error that
names both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from shardtrain.config import Config, ConfigError, ModelConfig
from shardtrain.model.hf import (assign, hf_tokenizer, holds, iter_hf_weights, load_hf_weights,
                                 materialize, save_hf, source_config)
from shardtrain.model.hf_names import model_config_from_hf
from shardtrain.model.transformer import Transformer, init_tensor
from shardtrain.parallel.build import Values
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.train.finetune.lora import apply_lora, lora_modules
from shardtrain.train.finetune.peft_format import (peft_adapter_values, resolve_lora_init,
                                          save_peft_adapters)

SHAPE_FIELDS = ("style", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                "max_seq_len", "tie_embeddings", "norm_eps", "rope_theta", "qkv_bias", "qk_norm",
                "head_size", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_len", "rope_attention_factor",
                "sliding_window", "n_experts", "moe_top_k", "moe_ffn_dim", "moe_first_dense",
                "moe_shared_experts", "moe_groups", "moe_max_groups", "moe_score", "attention",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "moe_route_scale", "moe_balance")


def resolve_init_from(cfg: Config) -> None:
    """With model.init_from set: take the model shape from the directory's config.json
    (a field set to another value is an error naming both), and its tokenizer.json as
    data.tokenizer unless one was chosen; with lora.init_from, the LoRA shape from its
    adapter_config.json. Idempotent."""
    resolve_lora_init(cfg)
    if not cfg.model.init_from:
        return
    path = Path(cfg.model.init_from).expanduser()
    hf = model_config_from_hf(path)
    default = ModelConfig()
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(cfg.model, name), getattr(hf, name)
        if name == "n_kv_heads":
            mine, theirs = cfg.model.n_kv_heads or theirs, hf.kv_heads
        elif name == "ffn_dim":
            mine, theirs = cfg.model.ffn_dim or theirs, hf.ffn_hidden
        elif name == "moe_balance" and theirs != "bias":
            continue  # a choice of training, unless the checkpoint holds an expert bias
        if mine != theirs and mine != getattr(default, name):
            raise ConfigError(f"model.{name}={mine!r} conflicts with {path / 'config.json'} "
                              f"({theirs!r}); drop model.{name}: model.init_from sets the shape")
        setattr(cfg.model, name, getattr(hf, name))
    tokenizer = hf_tokenizer(path)
    if tokenizer is not None and cfg.data.tokenizer == "byte":
        cfg.data.tokenizer = str(tokenizer)


def build_skeleton(cfg: Config, *, device: torch.device | str | None = None) -> Transformer:
    """The run's model structure (LoRA/QLoRA applied) on the meta device, or materialised
    on `device` with uninitialised weights (for a state dict to fill)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora, seed=cfg.train.seed)
    if device is not None:
        materialize(model, device=device)
    return model


def build_start_model(cfg: Config, *, device: torch.device | str = "cpu") -> Transformer:
    """The model a run starts from, on one process: seeded, or read from model.init_from,
    with LoRA/QLoRA applied when lora.rank > 0. Loading streams into the skeleton, so a
    QLoRA base is quantized tensor by tensor and never exists dense in full."""
    model = build_skeleton(cfg, device=device)
    model.init_weights(cfg.train.seed)  # the adapters; the rest too unless init_from loads it
    with torch.no_grad():
        if cfg.model.init_from:
            load_hf_weights(model, Path(cfg.model.init_from).expanduser(), cfg=cfg.model)
        for name, value in _nf4_values(cfg, model, lambda n: not cfg.model.init_from):
            assign(model, name, value)
        if cfg.lora.init_from:  # the adapters a peft run saved, in place of the drawn ones
            for name, value in peft_adapter_values(model, cfg):
                assign(model, name, value)
    return model


def start_values(cfg: Config, shards: StageShards) -> Values:
    """The value source of a layout's build (parallel/build.py): every tensor this rank
    holds, as its local block, one at a time -- the seeded draw by name, or model.init_from's
    weights streamed from its safetensors files; the adapters seeded, or lora.init_from's
    (a peft directory); and QLoRA's NF4 bases (quantized as they are written)."""
    model, seed = shards.model, cfg.train.seed
    hf, peft = bool(cfg.model.init_from), bool(cfg.lora.init_from)

    def values(wants: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        def drawn(name: str) -> bool:  # what no file provides (the families have no MTP)
            adapter = name.endswith((".lora_a", ".lora_b"))
            return wants(name) and not (peft if adapter else hf and not name.startswith("mtp."))

        yield from shards.initial_values(seed, drawn)
        if not hf:
            yield from _nf4_values(cfg, model, wants)
        else:
            for name, full in iter_hf_weights(Path(cfg.model.init_from).expanduser(), cfg.model):
                if holds(model, name) and wants(name):  # this stage's, this shard's
                    yield name, shards.shard_full(name, full)
                del full  # before the next is read
        if peft:
            yield from ((n, v) for n, v in peft_adapter_values(model, cfg, shard=shards.shard_full)
                        if wants(n))

    return values


def _nf4_values(cfg: Config, model: nn.Module, wants: Callable[[str], bool]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The seeded dense weights of the NF4 bases (buffers no parameter draw covers)."""
    for name, module in lora_modules(model).items():
        if module.nf4 is not None and wants(f"{name}.weight"):
            shape = (module.out_features, module.in_features)
            yield f"{name}.weight", init_tensor(f"{name}.weight", shape, cfg.train.seed, cfg.model)


def export_hf(model: nn.Module, cfg: Config, out: str | Path,
              tokenizer_file: str | Path | None = None) -> Path:
    """The model (LoRA merged, NF4 dequantized) as a Hugging Face directory; the source
    directory's config.json fields carried over when the run started from one."""
    base = source_config(Path(cfg.model.init_from).expanduser()) if cfg.model.init_from else None
    return save_hf(model, out, cfg=cfg.model, base_config=base, tokenizer_file=tokenizer_file)


def save_adapters(model: nn.Module, cfg: Config, out: str | Path) -> Path:
    """The adapters alone, as a peft adapter directory (adapter_model.safetensors and
    adapter_config.json) that `peft.PeftModel.from_pretrained(base, out)` loads."""
    return save_peft_adapters(model, cfg, out)


def nf4_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 base weights (QLoRA; buffers, which no parameter count sees)."""
    return sum(m.nf4.nbytes() for m in lora_modules(model).values() if m.nf4 is not None)
