"""The rows a batch is cut from, and the stores that hold them.

A row is `seq_len + 1` tokens: its first `seq_len` are a sequence's inputs, its last
`seq_len` the targets (shifted by one). A store holds `n` rows and hands out any of them by
index; the sampler (sampler.py) decides which. Two stores:

- `TextWindows`: the windows of a flat token stream at stride `seq_len` (every target
  counts);
- `ChatRows` (chat_rows.py): conversations rendered and packed or padded into rows, with
  a flag per token saying whether it is a target that counts (the assistant's tokens).

Under data.document_mask a row also says where documents begin, and the batch carries each
token's position inside its document ([B, S], model/positions.py): in a text stream a
document begins after each EOS; chat rows flag each conversation's first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardtrain.config.data import IGNORE

Batch = tuple[torch.Tensor, ...]  # (inputs, targets[, positions]), each [batch, seq_len] int64


@dataclass(frozen=True)
class Rows:
    tokens: np.ndarray  # [k, S + 1] int64
    counted: np.ndarray | None = None  # [k, S + 1] bool: the token is a target that counts
    starts: np.ndarray | None = None  # [k, S + 1] bool: a document begins here (document mask)

    def __getitem__(self, at: slice) -> Rows:
        return Rows(self.tokens[at], *(None if a is None else a[at]
                                       for a in (self.counted, self.starts)))

    def batch(self) -> Batch:
        """(inputs, targets) [k, S] each, targets IGNORE where they do not count, and the
        positions inside documents [k, S] when the rows mark document starts."""
        t = self.tokens
        targets = t[:, 1:] if self.counted is None else np.where(self.counted[:, 1:],
                                                                  t[:, 1:], IGNORE)
        out = [torch.from_numpy(np.ascontiguousarray(t[:, :-1])),
               torch.from_numpy(np.ascontiguousarray(targets))]
        if self.starts is not None:
            out.append(torch.from_numpy(document_positions(self.starts[:, :-1])))
        return tuple(out)


def concat(parts: list[Rows]) -> Rows:
    """Rows of one format stacked: every part has the same optional arrays."""
    def stack(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate(arrays)
    return Rows(np.concatenate([p.tokens for p in parts]), stack([p.counted for p in parts]),
                stack([p.starts for p in parts]))


def document_positions(starts: np.ndarray) -> np.ndarray:
    """Positions [k, S] int64 from document starts [k, S] (a row's first token always
    begins one): each document's tokens counted from 0."""
    k, s = starts.shape
    index = np.broadcast_to(np.arange(s), (k, s))
    begins = starts.copy()
    begins[:, 0] = True
    # The index of the latest start at or before each token: a running maximum.
    latest = np.maximum.accumulate(np.where(begins, index, 0), axis=1)
    return (index - latest).astype(np.int64)


def eos_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Document starts [k, S + 1] of text windows: after each EOS (and at the row start)."""
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    starts[:, 0] = True
    return starts


class TextWindows:
    """The windows of a flat token stream [N], window i its tokens [i S, (i+1) S + 1]."""

    unit = "windows"

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int | None = None) -> None:
        """`eos_id`: mark document starts after it (data.document_mask), else none."""
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, eos_id

    def take(self, ids: np.ndarray) -> Rows:
        return self.at(ids * self.seq_len)

    def at(self, starts: np.ndarray) -> Rows:
        """The windows starting at these token offsets."""
        # Fancy indexing reads only these windows' pages of a memmap, never the whole file.
        t = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)
        return Rows(t, starts=None if self.eos_id is None else eos_starts(t, self.eos_id))

    def counted(self, ids: np.ndarray) -> int:
        """The counted targets of these windows: all of them."""
        return len(ids) * self.seq_len

    def spread(self, k: int) -> Rows:
        """`k` windows spread evenly over the stream, from its first token to its last
        (held-out batches)."""
        last_start = len(self.tokens) - (self.seq_len + 1)
        return self.at(np.linspace(0, last_start, k).round().astype(np.int64))
