"""The corpus tokenized once into a flat binary file, memory-mapped read-only afterwards."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from shardtrain.config import DataConfig
from shardtrain.data import sources
from shardtrain.data.fsutil import build_once
from shardtrain.data.tokenizer import Tokenizer, encode_documents

# Bumped when the layout changes (e.g. the document separator), so old caches are not reused.
# 2: documents end with the tokenizer's EOS id (they ended with a newline).
_FORMAT = 2
_BATCH_CHARS = 1 << 22  # documents encoded per call: large enough for encode_batch to parallelise


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
            for docs in _batches(sources.iter_documents(cfg, source)):
                # Every document ends with EOS (data/tokenizer.py: encode_documents).
                f.write(encode_documents(tokenizer, docs).astype(dtype).tobytes())

    build_once(path, build)
    if path.stat().st_size == 0:  # mmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
