"""Tokenizers: raw UTF-8 bytes, or byte-level BPE (trained here or loaded from tokenizer.json)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import sources
from shardtrain.data.fsutil import build_once


class Tokenizer(Protocol):
    vocab_size: int
    name: str  # stable identity: equal names encode identically (part of cache keys)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        """Each text encoded on its own, the ids concatenated (1-D integer array)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return self.encode_concat([text]).tolist()

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        # Bytes do not interact across a boundary, so one join encodes them all at once.
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)


class BPETokenizer:
    """A `tokenizers` tokenizer read from a tokenizer.json; named by the file's hash."""

    def __init__(self, path: Path) -> None:
        self.path = path  # checkpoints carry a copy, so a model stays decodable on its own
        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size: int = self._tok.get_vocab_size()
        self.name = "bpe-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        encodings = self._tok.encode_batch(list(texts))  # parallel in Rust
        return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings]
                              or [np.zeros(0, dtype=np.int64)])


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """`data.tokenizer`: "byte", "bpe" (trained on the source, cached) or a tokenizer.json."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return BPETokenizer(train_bpe(cfg))
    path = Path(os.path.expanduser(cfg.tokenizer))
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r}: no such file; give 'byte', 'bpe' "
                          "or the path of an existing tokenizer.json")
    try:
        return BPETokenizer(path)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r}: not a valid tokenizer.json "
                          f"({e}); give a file saved by the `tokenizers` library") from None


def train_bpe(cfg: DataConfig) -> Path:
    """Train a byte-level BPE on the source once; the tokenizer.json path, keyed by the
    source fingerprint and vocabulary size under `data.cache_dir`."""
    key = hashlib.sha256(f"{sources.fingerprint(cfg)}:{cfg.bpe_vocab_size}".encode()).hexdigest()
    target = Path(os.path.expanduser(cfg.cache_dir)) / f"bpe-{key[:16]}" / "tokenizer.json"

    def build(tmp: Path) -> None:
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.bpe_vocab_size, show_progress=False, special_tokens=[],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte stays encodable
        tok.train_from_iterator(sources.iter_documents(cfg), trainer)
        tok.save(str(tmp))

    build_once(target, build)
    return target
