"""LoRA adapters in peft's format, out and in: `adapter_model.safetensors` and
`adapter_config.json`, as `peft.PeftModel.save_pretrained` writes them and
`PeftModel.from_pretrained(base, dir)` reads them.

peft names an adapter by the Hugging Face module it wraps
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight`
[out, r]) and scales it by lora_alpha / r, as train/finetune/lora.py does. The conversion is the base
weight's (model/hf_names.py `tensor_maps`): B's rows are the weight's output rows, so q/k
B rows are permuted between Hugging Face's rotate-half layout and shardtrain's interleaved
pairs exactly as the weight's are; A works on the input side, which no map changes.
GPT-2 is refused: peft adapts its fused c_attn [C, 3C] as one linear, while shardtrain
adapts q, k and v apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from shardtrain.config import Config, ConfigError, ModelConfig
from shardtrain.config.lora import TARGET_MODULES
from shardtrain.data.fsutil import usual_mode
from shardtrain.model.hf_names import TensorMap, tensor_maps

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."  # PeftModelForCausalLM -> the transformers model
HF_TARGETS = {t: f"{t}_proj" for t in TARGET_MODULES}  # q -> q_proj, ..., down -> down_proj
# adapter_config.json fields that change the arithmetic, and the value shardtrain implements.
PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none",
              "fan_in_fan_out": False, "layers_to_transform": None, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False}


def adapter_maps(cfg: ModelConfig, targets: list[str]) -> Iterator[tuple[str, str, TensorMap]]:
    """(peft key stem, our module name, the base weight's map) for every adapted linear."""
    if cfg.style != "llama":
        raise ConfigError("peft adapters for model.style=gpt2: peft adapts GPT-2's fused "
                          "c_attn as one linear and shardtrain adapts q, k, v apart; export "
                          "the merged model instead (shardtrain export without --adapters-only)")
    suffixes = tuple(f"{TARGET_MODULES[t]}.weight" for t in targets)
    for m in tensor_maps(cfg):
        if len(m.ours) == 1 and m.ours[0].endswith(suffixes):
            yield PREFIX + m.hf.removesuffix(".weight"), m.ours[0].removesuffix(".weight"), m


def save_peft_adapters(model: nn.Module, cfg: Config, out: str | Path) -> Path:
    """`model`'s adapters (a plain model with LoRA linears) as a peft adapter directory."""
    from safetensors.torch import save_file

    out = Path(out)
    tensors = {}
    for stem, module_name, m in adapter_maps(cfg.model, cfg.lora.target_list):
        module = model.get_submodule(module_name)
        tensors[f"{stem}.lora_A.weight"] = module.lora_a.detach().float().cpu().contiguous()
        tensors[f"{stem}.lora_B.weight"] = m.to_hf([module.lora_b.detach().float().cpu()]
                                                   ).contiguous()  # [out, r], HF's row order
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    usual_mode(out / WEIGHTS_FILE)
    meta = {**PLAIN_LORA, "task_type": "CAUSAL_LM", "r": cfg.lora.rank,
            "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
            "target_modules": sorted(HF_TARGETS[t] for t in cfg.lora.target_list),
            "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": cfg.model.init_from or None}
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json of a peft LoRA directory, checked to be plain LoRA (errors name
    the file, the field and what is supported)."""
    file = path / CONFIG_FILE
    if not file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(f"lora.init_from={str(path)!r}: a peft adapter directory holds "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE} (PeftModel.save_pretrained)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: malformed JSON ({e})") from None
    for key, plain in PLAIN_LORA.items():
        value = raw.get(key, plain)
        if value != plain and not (plain is None and value in ([], {})) \
                and not (plain == {} and value is None):
            raise ConfigError(f"{file}: {key}={value!r} is not supported (shardtrain loads "
                              f"plain LoRA adapters: {key}={plain!r})")
    names = raw.get("target_modules")
    known = {v: k for k, v in HF_TARGETS.items()}
    if not isinstance(names, list) or not names or any(n not in known for n in names):
        raise ConfigError(f"{file}: target_modules={names!r} is not supported; shardtrain "
                          f"adapts a list among {', '.join(known)}")
    if not isinstance(raw.get("r"), int) or raw["r"] < 1 or \
            not isinstance(raw.get("lora_alpha"), (int, float)) or raw["lora_alpha"] <= 0:
        raise ConfigError(f"{file}: r={raw.get('r')!r} and lora_alpha="
                          f"{raw.get('lora_alpha')!r} must be positive")
    return {"rank": raw["r"], "alpha": float(raw["lora_alpha"]),
            "targets": ",".join(t for t in TARGET_MODULES if HF_TARGETS[t] in names)}


def resolve_lora_init(cfg: Config) -> None:
    """With lora.init_from set: lora.rank, alpha and targets from its adapter_config.json
    (the adapters continue training as they were saved). Idempotent."""
    if not cfg.lora.init_from:
        return
    if not cfg.model.init_from:
        raise ConfigError(f"lora.init_from={cfg.lora.init_from!r}: adapters continue training "
                          "over their base model; set model.init_from to it")
    saved = read_adapter_config(Path(cfg.lora.init_from).expanduser())
    for name, value in saved.items():
        setattr(cfg.lora, name, value)


@torch.no_grad()
def peft_adapter_values(model: nn.Module, cfg: Config,
                        shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) of each of lora.init_from's adapters that `model` (a plain model with
    LoRA linears, or one pipeline stage of one) holds, one at a time; `shard(name, full)`
    gives this rank's slice (tensor parallelism). Shapes are checked against the model's."""
    from safetensors import safe_open

    from shardtrain.model.hf import holds

    file = Path(cfg.lora.init_from).expanduser() / WEIGHTS_FILE
    maps = list(adapter_maps(cfg.model, cfg.lora.target_list))
    with safe_open(str(file), framework="pt", device="cpu") as f:
        keys = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
                : k for k in f.keys()}
        wanted = {f"{stem}.lora_{ab}.weight" for stem, _, _ in maps for ab in "AB"}
        if set(keys) != wanted:
            odd = sorted(set(keys) ^ wanted)
            raise ConfigError(f"{file}: its tensors do not match {CONFIG_FILE}'s targets on "
                              f"this model (e.g. {odd[:2]}); the adapters were trained on "
                              "another base model than model.init_from")
        for stem, module_name, m in maps:
            a, b = (f.get_tensor(keys[f"{stem}.lora_{ab}.weight"]) for ab in "AB")
            for leaf, full in (("lora_a", a), ("lora_b", m.to_ours(b)[0])):
                name = f"{module_name}.{leaf}"
                if holds(model, name):
                    target = getattr(model.get_submodule(module_name), leaf)
                    value = full if shard is None else shard(name, full)
                    if value.shape != target.shape:
                        raise ConfigError(f"{file}: {stem}.lora_{leaf[-1].upper()} has shape "
                                          f"{list(full.shape)}, this model's "
                                          f"{list(target.shape)}")
                    yield name, value
