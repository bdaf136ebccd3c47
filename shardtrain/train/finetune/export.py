"""A sharded checkpoint as a model: loaded whole (`shardtrain generate`) or streamed out to a
Hugging Face directory (`shardtrain export`).

The export never holds the whole model: the model is built on the meta device (shapes
only), and each weight the Hugging Face layout asks for is made by materialising just the
module that owns it (an embedding, a linear; a LoRA linear with its base and adapters, or
its NF4 codes) from the checkpoint's pieces, reading the exported value (LoRA merged, NF4
dequantized), and releasing it; the writer holds one output file of at most
`max_shard_bytes` at a time (model/hf.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardtrain.ckpt.files import OLD_MANIFEST, SIDE, Reader
from shardtrain.config import Config, ConfigError
from shardtrain.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from shardtrain.model.hf import read_weight, save_hf, source_config
from shardtrain.parallel.pieces import model_key
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.finetune.finetune import build_skeleton


def open_checkpoint(path: Path) -> tuple[Reader, Config]:
    """The checkpoint's reader and config; a clear error if `path` is not a checkpoint."""
    if not (path / SIDE).is_file() and not (path / OLD_MANIFEST).is_file():
        raise ConfigError(f"--checkpoint {str(path)!r} is neither a checkpoint directory (it "
                          f"must hold {SIDE}, DCP's .metadata and config.toml) nor a Hugging "
                          "Face directory (with config.json); pass a "
                          "<run_dir>/checkpoints/step_* dir")
    ckpt.check_checkpoint(path, "--checkpoint")
    return Reader(path), ckpt.checkpoint_config(path)


def load_into(module: nn.Module, reader: Reader, prefix: str = "") -> None:
    """Set `module`'s state (its names under `prefix` in the single-process model)."""
    module.load_state_dict({k: reader.tensor(model_key(prefix + k))
                            for k in module.state_dict()})


def load_checkpoint_model(path: Path) -> tuple[nn.Module, Config]:
    """The plain model of a checkpoint directory (LoRA linears included) and its config."""
    reader, cfg = open_checkpoint(path)
    model = build_skeleton(cfg, device="cpu")
    load_into(model, reader)
    return model, cfg


@torch.no_grad()
def export_checkpoint(path: Path, out: str | Path, *, dtype: torch.dtype = torch.float32,
                      max_shard_bytes: int = 2 << 30) -> Path:
    """Write the checkpoint's model as a Hugging Face directory, streamed (module doc)."""
    reader, cfg = open_checkpoint(path)
    skeleton = build_skeleton(cfg)  # on the meta device

    def read(name: str) -> torch.Tensor:
        owner_name, _, leaf = name.rpartition(".")
        owner = skeleton.get_submodule(owner_name)
        owner.to_empty(device="cpu")
        try:
            load_into(owner, reader, f"{owner_name}.")
            return read_weight(owner, leaf).clone()
        finally:
            owner.to("meta")  # released: the next weight's module takes its place

    base = source_config(Path(cfg.model.init_from).expanduser()) if cfg.model.init_from \
        else special_token_ids(checkpoint_tokenizer(path, cfg))
    tokenizer = path / ckpt.TOKENIZER_FILE
    return save_hf(None, out, cfg=cfg.model, dtype=dtype, max_shard_bytes=max_shard_bytes,
                   base_config=base, tokenizer_file=tokenizer if tokenizer.is_file() else None,
                   read=read)


def checkpoint_tokenizer(path: Path, cfg: Config) -> Tokenizer | None:
    """The tokenizer a checkpoint was trained with: the tokenizer.json it carries, or the byte
    tokenizer; None for a tokenizer file it does not carry (data.tokenizer names it)."""
    saved = path / ckpt.TOKENIZER_FILE
    if saved.is_file():
        return BPETokenizer(saved)
    return ByteTokenizer() if cfg.data.tokenizer == "byte" else None


def special_token_ids(tokenizer: Tokenizer | None) -> dict[str, int | None]:
    """config.json's token ids of a fresh export: the run's own, where transformers' defaults
    (GPT-2's 50256, Llama's 1 and 2) would be another tokenizer's."""
    if tokenizer is None:
        return {}
    return {"bos_token_id": tokenizer.head[0] if tokenizer.head else None,
            "eos_token_id": tokenizer.eos_id}
