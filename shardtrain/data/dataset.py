"""The token stream split into a training part and a held-out eval tail."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data.cache import load_tokens
from shardtrain.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Dataset:
    train: np.ndarray  # [n_train] token ids (a read-only memmap view)
    eval: np.ndarray  # [n_eval] data.eval_source's stream, else the last eval_fraction
    tokenizer: Tokenizer


def load_dataset(cfg: DataConfig, *, seq_len: int = 1) -> Dataset:
    """Tokenize (or reuse the cache) and split; each split must hold one `seq_len` sequence."""
    tokenizer = load_tokenizer(cfg)
    tokens = load_tokens(cfg, tokenizer)
    if cfg.eval_source:  # a held-out set of its own: the whole source trains
        train, held_out = tokens, load_tokens(cfg, tokenizer, cfg.eval_source)
    else:
        n_eval = int(len(tokens) * cfg.eval_fraction)
        train, held_out = tokens[:len(tokens) - n_eval], tokens[len(tokens) - n_eval:]
    need = seq_len + 1  # a sequence's inputs plus its shifted targets
    if cfg.eval_source and len(held_out) < need:
        raise ConfigError(f"data.eval_source={cfg.eval_source!r} gives {len(held_out)} tokens, "
                          f"but one eval sequence needs seq_len + 1 = {need}; give a larger "
                          "eval source or lower train.seq_len")
    if min(len(train), len(held_out)) < need:
        raise ConfigError(
            f"data.source={cfg.source!r} gives {len(tokens)} tokens: {len(train)} for training "
            f"and {len(held_out)} for eval (data.eval_fraction={cfg.eval_fraction}), but one "
            f"sequence needs seq_len + 1 = {need} in each; add text (data.source, "
            "data.max_bytes) or lower train.seq_len")
    return Dataset(train=train, eval=held_out, tokenizer=tokenizer)


def check_vocab(dataset: Dataset, model_vocab_size: int) -> None:
    """The model's embedding must cover every token id the tokenizer can produce."""
    if dataset.tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({dataset.tokenizer.vocab_size}); raise model.vocab_size "
                          "or lower data.bpe_vocab_size")
