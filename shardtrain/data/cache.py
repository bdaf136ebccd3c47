"""The corpus tokenized once into a flat binary file, memory-mapped read-only afterwards."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from shardtrain.config import DataConfig
from shardtrain.data import sources
from shardtrain.data.fsutil import build_once
from shardtrain.data.tokenize import encode_stream
from shardtrain.data.tokenizer import Tokenizer

# Bumped when the layout changes (e.g. the document separator), so old caches are not reused.
# 2: documents end with the tokenizer's EOS id (they ended with a newline).
_FORMAT = 2


def cache_path(cfg: DataConfig, tokenizer: Tokenizer, source: str | None = None) -> Path:
    """`<cache_dir>/tokens-<hash>.<dtype>`, the hash of (format, source fingerprint, tokenizer);
    `source` defaults to data.source."""
    key = f"{_FORMAT}:{sources.fingerprint(cfg, source)}:{tokenizer.name}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cfg.cache_dir)) / f"tokens-{digest}.{_dtype(tokenizer).name}"


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer, source: str | None = None) -> np.ndarray:
    """The whole token stream of `source` (default data.source), [n_tokens], built on first
    use and mapped read-only."""
    path = cache_path(cfg, tokenizer, source)
    dtype = _dtype(tokenizer)

    def build(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            # Every document ends with EOS (data/tokenizer.py: encode_documents); written
            # batch by batch, by data.num_proc processes (data/tokenize.py).
            for ids in encode_stream(cfg, tokenizer, sources.iter_documents(cfg, source)):
                f.write(ids.astype(dtype).tobytes())

    build_once(path, build, timeout_s=cfg.lock_timeout_s)
    if path.stat().st_size == 0:  # mmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
