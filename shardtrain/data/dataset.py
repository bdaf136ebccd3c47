"""The training data: token streams (one, or a weighted mixture) or chat rows, and a
held-out set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data.cache import load_tokens
from shardtrain.data.chat_rows import ChatRows, load_chat_rows
from shardtrain.data.tokenizer import Tokenizer, load_tokenizer

Split = np.ndarray | ChatRows  # a token stream [n_tokens] (a read-only memmap view), or rows


@dataclass(frozen=True)
class Dataset:
    # a token stream or chat rows; a list of them, one per source, for a mixture
    # (data.sources), sampled by `weights`; empty streams under data.streaming
    train: Split | list[Split]
    eval: Split  # data.eval_source's, else the last eval_fraction of each source
    tokenizer: Tokenizer
    names: tuple[str, ...] = ()  # the training sources, as configured
    weights: tuple[float, ...] = ()
    document_eos: int | None = None  # text under data.document_mask: EOS ends a document
    summary: str = ""  # what the run prints about its data (chat: conversations, rows)


def load_dataset(cfg: DataConfig, *, seq_len: int = 1) -> Dataset:
    """Tokenize (or reuse the cache) and split; each split must hold one `seq_len` sequence."""
    tokenizer = load_tokenizer(cfg)
    chat = cfg.format == "chat"
    if cfg.document_mask and not chat and tokenizer.eos_id is None:
        raise ConfigError(f"data.document_mask=true finds documents by the tokenizer's EOS "
                          f"token, but data.tokenizer={cfg.tokenizer!r} names none; use a "
                          "tokenizer with an EOS token, or data.document_mask=false")
    mixture = cfg.mixture()
    trains, tails = [], []
    for source, _ in mixture:
        if cfg.streaming:  # read as training goes (data/stream.py): nothing cached here
            trains.append(np.zeros(0, dtype=np.int64))
            continue
        split = _chat_split if chat else _text_split
        train, held_out = split(cfg, tokenizer, source, seq_len)
        trains.append(train)
        tails.append(held_out)
    if cfg.eval_source:  # a held-out set of its own: the whole sources train
        held_out = _held_out(cfg, tokenizer, seq_len)
    else:  # a mixture's eval set: every source's tail (small: eval_fraction of each)
        held_out = tails[0] if len(tails) == 1 else _concat(tails)
    summary = "\n".join(t.summary for t in trains if isinstance(t, ChatRows))
    return Dataset(train=trains[0] if len(trains) == 1 else trains, eval=held_out,
                   tokenizer=tokenizer, names=tuple(s for s, _ in mixture),
                   weights=tuple(w for _, w in mixture), summary=summary,
                   document_eos=tokenizer.eos_id if cfg.document_mask and not chat else None)


def _text_split(cfg: DataConfig, tokenizer: Tokenizer, source: str, seq_len: int
                ) -> tuple[np.ndarray, np.ndarray]:
    tokens = load_tokens(cfg, tokenizer, source)
    need = seq_len + 1  # a sequence's inputs plus its shifted targets
    n_eval = 0 if cfg.eval_source else int(len(tokens) * cfg.eval_fraction)
    train, held_out = tokens[:len(tokens) - n_eval], tokens[len(tokens) - n_eval:]
    if len(train) < need or (not cfg.eval_source and len(held_out) < need):
        raise ConfigError(
            f"data.source={source!r} gives {len(tokens)} tokens: {len(train)} for training "
            f"and {len(held_out)} for eval (data.eval_fraction={cfg.eval_fraction}), but "
            f"one sequence needs seq_len + 1 = {need} in each; add text (data.source, "
            "data.max_bytes), give data.eval_source, or lower train.seq_len")
    return train, held_out


def _chat_split(cfg: DataConfig, tokenizer: Tokenizer, source: str, seq_len: int
                ) -> tuple[ChatRows, ChatRows]:
    rows = load_chat_rows(cfg, tokenizer, source, seq_len)
    n_eval = 0 if cfg.eval_source else int(rows.n * cfg.eval_fraction)
    if rows.n - n_eval < 1 or (not cfg.eval_source and n_eval < 1):
        raise ConfigError(
            f"data.source={source!r} gives {rows.n} rows of conversations: {rows.n - n_eval} "
            f"for training and {n_eval} for eval (data.eval_fraction={cfg.eval_fraction}), "
            "but each needs at least one; add conversations, give data.eval_source, or raise "
            "data.eval_fraction")
    return rows.split(n_eval)


def _held_out(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> Split:
    """data.eval_source's stream or rows."""
    if cfg.format == "chat":
        rows = load_chat_rows(cfg, tokenizer, cfg.eval_source, seq_len)
        if rows.n < 1:
            raise ConfigError(f"data.eval_source={cfg.eval_source!r} holds no conversations")
        return rows
    held_out = load_tokens(cfg, tokenizer, cfg.eval_source)
    if len(held_out) < seq_len + 1:
        raise ConfigError(f"data.eval_source={cfg.eval_source!r} gives {len(held_out)} "
                          f"tokens, but one eval sequence needs seq_len + 1 = {seq_len + 1}; "
                          "give a larger eval source or lower train.seq_len")
    return held_out


def _concat(tails: list[Split]) -> Split:
    if isinstance(tails[0], ChatRows):
        return ChatRows(np.concatenate([t.table for t in tails], axis=1),
                        document_mask=tails[0].document_mask)
    return np.concatenate(tails)


def check_vocab(dataset: Dataset, model_vocab_size: int) -> None:
    """The model's embedding must cover every token id the tokenizer can produce."""
    if dataset.tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({dataset.tokenizer.vocab_size}); raise model.vocab_size "
                          "or lower data.bpe_vocab_size")
