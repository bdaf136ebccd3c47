"""Tokenization of a document stream by `data.num_proc` processes, in document order.

The reader (this process) cuts documents into batches of about `BATCH_CHARS` characters;
worker processes encode batches; results are taken back in submission order, so the token
stream is the same bytes whatever the process count. At most two batches per worker are in
flight, so memory stays bounded however large the corpus: the cache file (data/cache.py) is
written batch by batch as results come back.

A corpus of one batch is encoded here, without workers: starting them (a fresh interpreter
each, importing the tokenizer) costs more than a small corpus takes.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from itertools import chain, islice
from multiprocessing import current_process

import numpy as np

from shardtrain.config import DataConfig
from shardtrain.data.tokenizer import Tokenizer, encode_documents, load_tokenizer
from shardtrain.data.workers import process_pool

BATCH_CHARS = 1 << 20  # characters per batch: enough for encode_batch to parallelise; a BPE
# batch of 1 M characters takes about 90 MiB to encode (4 M: 180 MiB), 1 M is no slower
_worker_tokenizer: Tokenizer | None = None


def processes(cfg: DataConfig) -> int:
    """data.num_proc, 0 meaning the cores this process may run on."""
    return cfg.num_proc or len(os.sched_getaffinity(0))


def encode_stream(cfg: DataConfig, tokenizer: Tokenizer, docs: Iterable[str]
                  ) -> Iterator[np.ndarray]:
    """The token ids of `docs` ([BOS] doc EOS each), one array per batch, in order."""
    batches = _batches(docs)
    head = list(islice(batches, 2))
    n_proc = processes(cfg)
    # A daemonic process (some launchers start ranks so) may not start workers: encode here.
    if n_proc <= 1 or len(head) < 2 or current_process().daemon:
        for batch in chain(head, batches):
            yield encode_documents(tokenizer, batch)
        return
    # Spawned workers that never re-run the entry script (data/workers.py).
    with process_pool(n_proc, _start, (cfg,)) as pool:
        pending: deque[Future[np.ndarray]] = deque()
        for batch in chain(head, batches):
            pending.append(pool.submit(_encode, batch))
            if len(pending) >= 2 * n_proc:  # bounded: wait for the oldest before reading on
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _start(cfg: DataConfig) -> None:
    global _worker_tokenizer  # one per worker process, loaded once (a trained BPE is cached)
    _worker_tokenizer = load_tokenizer(cfg)


def _encode(docs: list[str]) -> np.ndarray:
    assert _worker_tokenizer is not None
    return encode_documents(_worker_tokenizer, docs)


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
