"""Hugging Face model directories in and out: config.json + safetensors (one file, or
shards listed by model.safetensors.index.json), and a tokenizer.json when present.

Loading streams: the model is built on the meta device, given uninitialised storage, and
each checkpoint tensor is read alone (safetensors `safe_open`), converted (hf_names.py)
and copied into place, so peak memory is one model plus one tensor. Saving writes shards
of at most `max_shard_bytes`, so it holds one shard at a time next to the model.

A module may take part in the conversion: one with `load_weight(tensor)` receives its
weight through it (a QLoRA linear quantizes it on arrival), and one with
`export_weight()` gives the weight to write (a LoRA linear its merged weight).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.hf_names import (IGNORED_SUFFIXES, beyond_the_model, canonical_name,
                                       hf_config_from_model, model_config_from_hf,
                                       read_config_json, tensor_maps)
from shardtrain.model.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory, in the index's order."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: malformed index ({type(e).__name__}: {e}); it must "
                              "hold a 'weight_map' object of tensor name -> file") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ConfigError(f"{index}: lists {missing[0]!r}, which is not in {path}")
        return [path / n for n in names]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise ConfigError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; shardtrain reads safetensors "
                      "checkpoints (save_pretrained(..., safe_serialization=True))")


def hf_tokenizer(path: str | os.PathLike) -> Path | None:
    """The directory's tokenizer.json, if it has one."""
    file = Path(path) / TOKENIZER_FILE
    return file if file.is_file() else None


def load_hf(path: str | os.PathLike, *, device: str | torch.device = "cpu",
            dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer with the weights of a Hugging Face directory (hf_names.SUPPORTED)."""
    path = Path(path)
    cfg = model_config_from_hf(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize(model, device=device, dtype=dtype)
    load_hf_weights(model, path)
    return model


def materialize(model: Transformer, *, device: str | torch.device,
                dtype: torch.dtype = torch.float32) -> None:
    """Uninitialised storage for a meta-device model (every weight is then overwritten by
    load_hf_weights); RoPE tables and tied weights set as build_model does."""
    model.to_empty(device=device)
    if dtype != torch.float32:
        model.to(dtype)
    model.init_buffers()


def iter_hf_weights(path: str | os.PathLike, cfg: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(shardtrain parameter name, full tensor) for every weight of a Hugging Face
    checkpoint of `cfg`, read one tensor at a time. Every tensor the config implies must be
    present with the shape the config implies; errors name the file and the tensor."""
    path = Path(path)
    with torch.device("meta"):
        reference = Transformer(cfg)  # shapes only
    shapes = {n: p.shape for n, p in [*reference.named_parameters(remove_duplicate=False),
                                      *reference.named_buffers()]}  # the expert bias too
    maps = {m.hf: m for m in tensor_maps(cfg)}
    tied_head = "lm_head.weight" if cfg.tie_embeddings else None
    seen: set[str] = set()
    pending: dict[str, dict[int, torch.Tensor]] = {}  # stacked experts being read
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = canonical_name(cfg, key)
                if name == tied_head or name.endswith(IGNORED_SUFFIXES) or \
                        beyond_the_model(cfg, name):  # DeepSeek-V3's MTP modules
                    continue  # a tied head repeats the embedding; buffers hold nothing
                m = maps.get(name)
                if m is None:
                    raise ConfigError(f"{file}: tensor {key!r} has no place in a "
                                      f"{cfg.style} model with the shape of "
                                      f"{path / 'config.json'}")
                tensor = f.get_tensor(key)
                expected = m.to_hf([torch.empty(shapes[n], device="meta") for n in m.ours]).shape
                if tensor.shape != expected:
                    raise ConfigError(
                        f"{file}: tensor {key!r} has shape {list(tensor.shape)}, but "
                        f"{path / 'config.json'} implies {list(expected)}; the weights and "
                        "the config.json come from different models")
                seen.add(name)
                if m.expert is None:
                    yield from zip(m.ours, m.to_ours(tensor))
                    continue
                parts = pending.setdefault(m.ours[0], {})  # E tensors fill one of ours
                parts[m.expert] = tensor
                if len(parts) == cfg.n_experts:
                    yield m.ours[0], torch.stack([parts[e] for e in range(cfg.n_experts)])
                    del pending[m.ours[0]]
    missing = [n for n in maps if n not in seen]
    if missing:
        raise ConfigError(f"{path}: the safetensors files lack {len(missing)} tensor(s) that "
                          f"{path / 'config.json'} implies, e.g. {missing[:3]}")


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike, *, cfg: ModelConfig | None = None,
                    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy a Hugging Face checkpoint into `model` (a Transformer, perhaps with LoRA
    linears, or one pipeline stage of one: the names it lacks are skipped); `shard(name,
    full)` gives this rank's slice of each tensor under tensor parallelism."""
    cfg = cfg or model.cfg
    for name, value in iter_hf_weights(path, cfg):
        if holds(model, name):
            assign(model, name, value if shard is None else shard(name, value))
    if cfg.tie_embeddings and hasattr(model, "tie_weights"):
        model.tie_weights()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = name.rpartition(".")
    return model.get_submodule(module_name), leaf


def holds(model: nn.Module, name: str) -> bool:
    """Whether `model` (or this pipeline stage of it) has the weight `name`."""
    try:
        module, leaf = _owner(model, name)
    except AttributeError:
        return False
    return hasattr(module, leaf)  # an NF4 linear's weight attribute is None, but it is there


def assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module, leaf = _owner(model, name)
    if leaf == "weight" and hasattr(module, "load_weight"):
        module.load_weight(value)
    else:
        getattr(module, leaf).copy_(value)


def read_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The weight `name` as an exported model has it (a LoRA layer's merged)."""
    module, leaf = _owner(model, name)
    if leaf == "weight" and hasattr(module, "export_weight"):
        return module.export_weight()
    return getattr(module, leaf).detach()


@torch.no_grad()
def save_hf(model: nn.Module | None, path: str | os.PathLike, *, cfg: ModelConfig | None = None,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 << 30,
            base_config: dict[str, Any] | None = None,
            tokenizer_file: str | os.PathLike | None = None,
            read: Callable[[str], torch.Tensor] | None = None) -> Path:
    """Write `model` as a Hugging Face directory that `from_pretrained` loads: config.json
    (the fields of `base_config` kept, shape fields from the model), safetensors shards of
    at most `max_shard_bytes` (one file when it fits, else an index), the tokenizer.json.
    `read(name)`: each weight by our name, instead of a model (a checkpoint streamed:
    train/finetune/export.py); one output shard is held at a time."""
    from safetensors.torch import save_file

    path = Path(path)
    cfg = cfg or model.cfg
    read = read or (lambda name: read_weight(model, name))
    config = hf_config_from_model(cfg, base_config, dtype=str(dtype).removeprefix("torch."))
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous export's shards would shadow this one
    shards: list[dict[str, str]] = []  # temporary file name -> tensors in it
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            tmp = path / f".shard-{len(shards)}.safetensors"
            save_file(shard, str(tmp), metadata={"format": "pt"})
            mask = os.umask(0)  # safetensors creates its file 0600: the mode open() gives
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
            shards.append({"file": tmp.name, "names": list(shard)})
            shard, size = {}, 0

    last: dict[str, torch.Tensor] = {}  # the stacked experts the next maps slice

    def read_once(name: str) -> torch.Tensor:
        if name not in last:
            last.clear()
            last[name] = read(name)
        return last[name]

    for m in tensor_maps(cfg):
        tensor = m.to_hf([read_once(n) for n in m.ours]).to("cpu", dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[m.hf] = tensor
        size, total = size + nbytes, total + nbytes
    flush()
    if len(shards) == 1:
        os.replace(path / shards[0]["file"], path / SINGLE_FILE)
    else:
        weight_map = {}
        for i, s in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(path / s["file"], path / final)
            weight_map.update(dict.fromkeys(s["names"], final))
        (path / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_file is not None and Path(tokenizer_file).resolve() != (path / TOKENIZER_FILE).resolve():
        shutil.copyfile(tokenizer_file, path / TOKENIZER_FILE)
    return path


def source_config(path: str | os.PathLike) -> dict[str, Any]:
    """The raw config.json of a Hugging Face directory (to carry its extra fields over)."""
    return read_config_json(Path(path))
