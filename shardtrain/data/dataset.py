"""The token streams: the training sources (one, or a weighted mixture) and a held-out set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data.cache import load_tokens
from shardtrain.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Dataset:
    # [n_train] token ids (a read-only memmap view); a list of them, one per source, for a
    # mixture (data.sources), sampled by `weights`; empty under data.streaming
    train: np.ndarray | list[np.ndarray]
    eval: np.ndarray  # [n_eval] data.eval_source's stream, else the last eval_fraction
    tokenizer: Tokenizer
    names: tuple[str, ...] = ()  # the training sources, as configured
    weights: tuple[float, ...] = ()


def load_dataset(cfg: DataConfig, *, seq_len: int = 1) -> Dataset:
    """Tokenize (or reuse the cache) and split; each split must hold one `seq_len` sequence."""
    tokenizer = load_tokenizer(cfg)
    mixture = cfg.mixture()
    need = seq_len + 1  # a sequence's inputs plus its shifted targets
    trains, tails = [], []
    for source, _ in mixture:
        if cfg.streaming:  # read as training goes (data/stream.py): nothing cached here
            trains.append(np.zeros(0, dtype=np.int64))
            continue
        tokens = load_tokens(cfg, tokenizer, source)
        n_eval = 0 if cfg.eval_source else int(len(tokens) * cfg.eval_fraction)
        train, held_out = tokens[:len(tokens) - n_eval], tokens[len(tokens) - n_eval:]
        if len(train) < need or (not cfg.eval_source and len(held_out) < need):
            raise ConfigError(
                f"data.source={source!r} gives {len(tokens)} tokens: {len(train)} for training "
                f"and {len(held_out)} for eval (data.eval_fraction={cfg.eval_fraction}), but "
                f"one sequence needs seq_len + 1 = {need} in each; add text (data.source, "
                "data.max_bytes), give data.eval_source, or lower train.seq_len")
        trains.append(train)
        tails.append(held_out)
    if cfg.eval_source:  # a held-out set of its own: the whole sources train
        held_out = load_tokens(cfg, tokenizer, cfg.eval_source)
        if len(held_out) < need:
            raise ConfigError(f"data.eval_source={cfg.eval_source!r} gives {len(held_out)} "
                              f"tokens, but one eval sequence needs seq_len + 1 = {need}; give "
                              "a larger eval source or lower train.seq_len")
    else:  # a mixture's eval set: every source's tail (small: eval_fraction of each)
        held_out = tails[0] if len(tails) == 1 else np.concatenate(tails)
    return Dataset(train=trains[0] if len(trains) == 1 else trains, eval=held_out,
                   tokenizer=tokenizer, names=tuple(s for s, _ in mixture),
                   weights=tuple(w for _, w in mixture))


def check_vocab(dataset: Dataset, model_vocab_size: int) -> None:
    """The model's embedding must cover every token id the tokenizer can produce."""
    if dataset.tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({dataset.tokenizer.vocab_size}); raise model.vocab_size "
                          "or lower data.bpe_vocab_size")
