"""Context parallelism's load balance under packed documents (parallel/context/balance.py):
the chunks' causal work counted from the documents, the pairing that minimises the busiest
rank's work, the same attention over any pairing, and the work the ring really does."""

from __future__ import annotations

import itertools

import torch

from shardtrain.model.positions import Documents
from shardtrain.parallel.context import SequenceSplit, simulated_ring_attention
from shardtrain.parallel.context.balance import balanced, chunk_work, held_positions
from shardtrain.parallel.context.blocks import DIAG, chunk_pairs, pair_blocks
from tests.test_document_attention import alone, close, out_and_grads, packed

# 48 tokens a row, skewed: a long document then a short one, so the head-tail pairs are
# uneven (at cp = 2 rank 1's work is 2.4x rank 0's).
SKEWED = [(36, 12), (5, 11, 16, 16)]


def _documents(lengths) -> Documents:
    return Documents.from_positions(packed(lengths)[4])


def _loads(split: SequenceSplit, work: list[int]) -> list[int]:
    return [sum(work[c] for c in split.chunks(r)) for r in range(split.cp)]


def _pairings(chunks: list[int]):
    """Every way to cut `chunks` into pairs."""
    if not chunks:
        yield ()
        return
    first, rest = chunks[0], chunks[1:]
    for i, other in enumerate(rest):
        for tail in _pairings(rest[:i] + rest[i + 1:]):
            yield ((first, other),) + tail


def test_chunk_work_counts_each_tokens_keys_inside_its_document():
    docs = _documents(SKEWED)
    for c in (6, 12, 24):
        want = [0] * (48 // c)
        for spans in docs.spans:
            for a, b in spans:
                for t in range(a, b):
                    want[t // c] += t - a + 1
        assert chunk_work(docs, c) == want


def test_the_pairs_are_the_best_pairing_and_head_tail_for_one_document():
    docs = _documents(SKEWED)
    for cp in (2, 4):
        split = SequenceSplit(48, cp, True)
        work = chunk_work(docs, split.chunk_len)
        best = min(max(work[a] + work[b] for a, b in p)
                   for p in _pairings(list(range(2 * cp))))
        got = balanced(split, docs)
        assert sorted(c for r in range(cp) for c in got.chunks(r)) == list(range(2 * cp))
        assert max(_loads(got, work)) == best < max(_loads(split, work)), cp
    one = _documents([(48,), (48,)])
    for cp in (2, 4):
        split = SequenceSplit(48, cp, True)
        assert balanced(split, one) is split  # the head-tail pairs, unchanged
    contiguous = SequenceSplit(48, 2, False)
    assert balanced(contiguous, docs) is contiguous  # the user chose no balance


def test_the_ring_does_the_counted_work_and_the_same_attention():
    """Per rank, the score elements of the ring's kernel calls (over all steps) equal the
    balanced work counted for its chunks (causal pairs on the diagonal count their
    triangle); attention over the balanced pairs equals per-document attention."""
    docs = _documents(SKEWED)
    for cp in (2, 4):
        split = balanced(SequenceSplit(48, cp, True), docs)
        work, c = chunk_work(docs, split.chunk_len), split.chunk_len
        for r in range(cp):
            done = 0
            for owner in range(cp):
                mine, theirs = split.chunks(r), split.chunks(owner)
                for qi, ki, kind in chunk_pairs(mine, theirs, True):
                    for blk in pair_blocks(mine[qi], theirs[ki], c, kind, docs):
                        done += blk.n * (blk.n + 1) // 2 if kind == DIAG else blk.n * blk.m
            assert done == _loads(split, work)[r], (cp, r)
        held = torch.cat([held_positions(SequenceSplit(48, cp, True), r, torch.device("cpu"),
                                         docs) for r in range(cp)])
        assert torch.equal(held, split.order("cpu"))
    q, k, v, dout, _ = packed(SKEWED)
    want = out_and_grads(lambda *x: alone(*x, SKEWED), q, k, v, dout, torch.float32)
    for cp in (2, 4):
        split = balanced(SequenceSplit(48, cp, True), docs)
        assert split.assignment is not None
        got = out_and_grads(lambda *x: simulated_ring_attention(
            *x, split=split, documents=docs), q, k, v, dout, torch.float32)
        close(got, want, torch.float32, f"balanced ring cp={cp}")
    assert len(list(itertools.islice(_pairings(list(range(8))), 200))) == 105
