"""Chat conversations as training rows: rendered (data/chat.py), then packed or padded into
rows of `seq_len + 1` tokens, cached once per source, tokenizer, template and layout.

Each row holds tokens and a flag per token: COUNTED, the token is a target the loss
counts (the assistant's, or every token with data.assistant_only_loss = false); START, a
conversation (or the padding after the last one) begins here. A conversation's first token
is never counted: nothing before it in its own conversation predicts it.

- data.document_mask = true: conversations are packed in order, each into the current row
  if it fits whole, else into a fresh row (the rest of the current one padded), so none
  crosses a row's end; attention stays inside each (model/positions.py).
- false: one conversation per row, padded.

Padding is the tokenizer's pad token (else its EOS, else 0) and never counted. A
conversation longer than a row is cut to it (counted in the summary the run prints).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from shardtrain.config import DataConfig
from shardtrain.data import sources
from shardtrain.data.chat import conversations, load_chat_tokenizer, render
from shardtrain.data.fsutil import build_once, write_atomic
from shardtrain.data.rows import Rows
from shardtrain.data.tokenizer import Tokenizer

COUNTED, START = 1, 2  # flag bits
_FORMAT = 1  # bumped when the layout of the cached table changes


class ChatRows:
    """Rows of conversations: `table` [2, n, S + 1] int32, tokens then flags."""

    unit = "rows"

    def __init__(self, table: np.ndarray, *, document_mask: bool, summary: str = "") -> None:
        self.table, self.document_mask, self.summary = table, document_mask, summary
        self.n = table.shape[1]

    def take(self, ids: np.ndarray) -> Rows:
        flags = self.table[1][ids]
        return Rows(self.table[0][ids].astype(np.int64), (flags & COUNTED).astype(bool),
                    (flags & START).astype(bool) if self.document_mask else None)

    def counted(self, ids: np.ndarray) -> int:
        """The counted targets of these rows (a row's first token is never a target)."""
        return int(np.count_nonzero(self.table[1][ids, 1:] & COUNTED))

    def spread(self, k: int) -> Rows:
        """`k` rows spread evenly over the set (held-out batches)."""
        return self.take(np.linspace(0, self.n - 1, k).round().astype(np.int64))

    def split(self, n_tail: int) -> tuple[ChatRows, ChatRows]:
        """(all but the last `n_tail` rows, those rows)."""
        cut = self.n - n_tail
        return (ChatRows(self.table[:, :cut], document_mask=self.document_mask,
                         summary=self.summary),
                ChatRows(self.table[:, cut:], document_mask=self.document_mask))


def pack(conversations: Iterable[tuple[list[int], list[bool]]], length: int, *, packed: bool,
         pad_id: int) -> tuple[np.ndarray, dict[str, int]]:
    """Rows [2, n, length] (tokens, flags) of the conversations (ids, counted per token),
    and counts for the summary."""
    rows: list[np.ndarray] = []
    row = np.zeros((2, 0), dtype=np.int32)
    stats = {"conversations": 0, "cut": 0}

    def close() -> None:
        pad = length - row.shape[1]
        padding = np.zeros((2, pad), dtype=np.int32)
        padding[0] = pad_id
        padding[1, :1] = START  # the padding is a document of its own under the mask
        rows.append(np.concatenate([row, padding], axis=1))

    for ids, counted in conversations:
        if not ids:
            continue
        stats["conversations"] += 1
        if len(ids) > length:
            ids, counted = ids[:length], counted[:length]
            stats["cut"] += 1
        piece = np.array([ids, [COUNTED * bool(c) for c in counted]], dtype=np.int32)
        piece[1, 0] = START  # and never counted
        if row.shape[1] and (not packed or row.shape[1] + piece.shape[1] > length):
            close()
            row = row[:, :0]
        row = np.concatenate([row, piece], axis=1)
    if row.shape[1]:
        close()
    table = np.stack(rows, axis=1) if rows else np.zeros((2, 0, length), dtype=np.int32)
    return table, stats


def load_chat_rows(cfg: DataConfig, tokenizer: Tokenizer, source: str, seq_len: int
                   ) -> ChatRows:
    """The rows of `source`, built on first use under data.cache_dir and mapped read-only.
    `tokenizer`: data.tokenizer loaded (data/tokenizer_files.py), whose template keys the
    cache; transformers renders only when the rows are built (its import takes seconds)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    key = json.dumps([_FORMAT, sources.fingerprint(cfg, source), tokenizer.name,
                      hashlib.sha256(template.encode()).hexdigest(), seq_len,
                      cfg.document_mask, cfg.assistant_only_loss, cfg.messages_field])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = Path(os.path.expanduser(cfg.cache_dir)) / f"chat-{digest}.npy"
    stats_path = path.with_suffix(".json")

    def build(tmp: Path) -> None:
        tok = load_chat_tokenizer(cfg)
        pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        rendered = (render(tok, messages, where) for where, messages in conversations(cfg, source))
        if not cfg.assistant_only_loss:  # every token counts (but each conversation's first)
            rendered = ((ids, [True] * len(ids)) for ids, _ in rendered)
        table, stats = pack(rendered, seq_len + 1, packed=cfg.document_mask, pad_id=pad_id)
        stats["counted"] = int(np.count_nonzero(table[1, :, 1:] & COUNTED))
        write_atomic(stats_path, json.dumps(stats))  # first: a published table has its stats
        with open(tmp, "wb") as f:
            np.save(f, table)

    build_once(path, build, timeout_s=cfg.lock_timeout_s)
    table = np.load(path, mmap_mode="r")
    stats = json.loads(stats_path.read_text())
    targets = table.shape[1] * seq_len
    summary = (f"chat {source}: {stats['conversations']} conversations in {table.shape[1]} rows "
               f"of {seq_len + 1} tokens ({'packed' if cfg.document_mask else 'padded'}), "
               f"{stats['cut']} cut to fit; {stats['counted'] / max(targets, 1):.1%} of targets "
               f"count ({'the assistant' if cfg.assistant_only_loss else 'every token'})")
    return ChatRows(table, document_mask=cfg.document_mask, summary=summary)
