"""The zig-zag split's chunk pairs under packed documents: paired by causal work.

With one causal sequence per row, chunk i's queries see (i + 1/2) chunks of keys, so the
head-tail pairs (i, 2N-1-i) give every rank the same work. Packed documents break that: a
token sees only its own document's earlier tokens, so a chunk's work depends on where the
documents lie. Rows of [3S/4, S/4] at N = 2: head-tail gives rank 1 four times rank 0's
work. Here each chunk's work is counted from the batch's spans (sum over its tokens of the
keys each sees, all rows), the 2N chunks are sorted by it and the heaviest is paired with
the lightest, the second with the second lightest, and so on: the pairing whose heaviest
pair is the lightest possible (exchanging two chunks between pairs never lowers it). A
single document per row sorts the chunks in position order, so the pairs are head-tail.

A pure function of the spans, which every cp rank holds whole, so the ranks agree on the
pairs with no message. Ring and Ulysses read the result (`SequenceSplit.assignment`), the
pipeline's slicing and RoPE take the tokens it names.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from shardtrain.model.positions import Documents
from shardtrain.parallel.context.split import SequenceSplit


def chunk_work(documents: Documents, chunk_len: int) -> list[int]:
    """Per chunk of `chunk_len` positions: the (query, key) pairs its queries attend to,
    summed over the rows. A document [a, b) gives token t the keys a..t: t - a + 1."""
    work = [0] * (documents.seq_len // chunk_len)
    for spans in documents.spans:
        for a, b in spans:
            for c in range(a // chunk_len, (b - 1) // chunk_len + 1):
                lo, hi = max(a, c * chunk_len), min(b, (c + 1) * chunk_len)  # [lo, hi)
                # sum over t in [lo, hi) of (t - a + 1)
                work[c] += (hi - lo) * (lo + hi - 1 - 2 * a + 2) // 2
    return work


@lru_cache(maxsize=64)
def balanced(split: SequenceSplit, documents: Documents) -> SequenceSplit:
    """`split` with its chunks paired by the documents' work (zig-zag splits; a contiguous
    split is the user's choice of no balance and comes back as it is)."""
    if not split.zigzag:
        return split
    work = chunk_work(documents, split.chunk_len)
    ranked = sorted(range(split.n_chunks), key=lambda c: (work[c], c))  # ties: by position
    # Each pair's chunks ascending; the pairs by their first chunk, so rank r keeps chunk r
    # wherever the head-tail pairs are the balanced ones.
    pairs = tuple(sorted(tuple(sorted((ranked[-1 - r], ranked[r]))) for r in range(split.cp)))
    if pairs == tuple(split.chunks(r) for r in range(split.cp)):
        return split
    return SequenceSplit(split.seq_len, split.cp, True, pairs)


@lru_cache(maxsize=64)
def _held(split: SequenceSplit, rank: int, device: torch.device) -> torch.Tensor:
    return split.positions(rank, device)


def held_positions(split: SequenceSplit, rank: int, device: torch.device,
                   documents: Documents | None) -> torch.Tensor:
    """int64 [S/N]: the global positions rank holds of a batch with `documents` (None: no
    packed documents, the fixed split)."""
    return _held(split if documents is None else balanced(split, documents), rank, device)
