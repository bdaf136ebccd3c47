"""data.streaming: windows read and tokenized on the fly, for corpora larger than the cache.

The training stream is the source's documents in order ([BOS] doc EOS each), epoch after
epoch, cut into windows of `seq_len + 1` tokens at stride `seq_len`, as the cached stream is
(data/sampler.py), but not shuffled: a stream has no random access, so windows come in
source order (shuffle the source beforehand). Step k's global batch is windows
[k*G, (k+1)*G); every rank reads the stream and keeps its contiguous 1/dp of each batch, so
any data-parallel layout sees exactly the sequences one process would.

Exact resume: the checkpoint holds where the next unread token lies (epoch, document index,
tokens of that document already used). A resumed run skips that many documents without
tokenizing them (it still reads them: files and streamed tables have no random access by
document), tokenizes the current one, drops the used tokens, and goes on with bit-for-bit
the batches the uninterrupted run would have had.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardtrain.config import DataConfig
from shardtrain.data import sources
from shardtrain.data.dataset import Dataset
from shardtrain.data.rows import Batch, Rows, eos_starts
from shardtrain.data.sampler import TokenSampler
from shardtrain.data.tokenizer import Tokenizer, encode_documents


def make_sampler(cfg: DataConfig, data: Dataset, **geometry: int) -> TokenSampler | StreamSampler:
    """The training sampler: over the cached streams, or reading the source (data.streaming).
    `geometry`: seq_len, global_batch, micro_batch, dp_rank, dp_size, seed."""
    if cfg.streaming:
        return StreamSampler(cfg, data.tokenizer, eos_id=data.document_eos, **geometry)
    return TokenSampler(data.train, weights=data.weights, eos_id=data.document_eos, **geometry)


class StreamSampler:
    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int,
                 global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, eos_id: int | None = None, groups: int = 1) -> None:
        """`eos_id`: mark documents for data.document_mask (TokenSampler's). `groups`:
        replica groups, which need TokenSampler's cursor (config/replicas.py refuses)."""
        if groups != 1:
            raise ValueError("data.streaming has no per-group share: parallel.replicas=1")
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global_batch={global_batch} is not divisible by micro_batch="
                             f"{micro_batch} x dp_size={dp_size}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.step = 0
        self.eos_id = eos_id
        self.loss_tokens = global_batch * seq_len  # every target of a text stream counts
        self._start(epoch=0, doc=0, skip=0)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""
        span = self.global_batch * self.seq_len  # tokens the global batch moves the stream by
        self._fill(span + 1)
        starts = np.arange(self.global_batch) * self.seq_len
        per_rank = self.global_batch // self.dp_size
        mine = starts[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        windows = self._buf[mine[:, None] + np.arange(self.seq_len + 1)]  # [per_rank, S + 1]
        self._drop(span)
        self.step += 1
        rows = Rows(windows.astype(np.int64), starts=None if self.eos_id is None
                    else eos_starts(windows, self.eos_id))
        return [rows[i:i + self.micro_batch].batch() for i in range(0, per_rank, self.micro_batch)]

    def describe(self, names: Any, steps: int) -> str:
        return ""  # one source: no mixture to report

    def state_dict(self) -> dict[str, Any]:
        if self._docs:  # the front document, partly used
            position = [self._docs[0][0], self._docs[0][1], self._used]
        else:  # the buffer ended on a document boundary: the next document to read
            position = [*self._next, 0]
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "streaming": True, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self.state_dict()
        for key in ("seq_len", "global_batch", "streaming"):
            if state.get(key) != now[key]:
                raise ValueError(f"data sampler resume mismatch: {key} was {state.get(key)} in "
                                 f"the checkpoint but is {now[key]} now; resume with the "
                                 "original data.streaming and batch settings")
        self.step = int(state["step"])
        epoch, doc, used = state["position"]
        self._start(epoch=epoch, doc=doc, skip=used)

    # ------------------------------------------------------------------ the stream

    def _start(self, *, epoch: int, doc: int, skip: int) -> None:
        """Position the stream at token `skip` of document `doc` of epoch `epoch`."""
        self._next = (epoch, doc)  # the next document the reader yields (past an epoch's end:
        # _documents moves on to the next epoch)
        self._reader = self._documents(epoch, doc)
        self._buf = np.zeros(0, dtype=np.int64)  # the stream from the front document's `_used`
        self._docs: deque[tuple[int, int, int]] = deque()  # (epoch, doc, n_tokens) in _buf
        self._used = 0  # tokens of the front document no longer in the buffer
        if skip:
            self._fill(1)
            self._drop(skip)

    def _documents(self, epoch: int, first: int) -> Iterator[tuple[int, int, str]]:
        """(epoch, index, text) from document `first` of `epoch` on, epoch after epoch;
        the skipped documents are read, not tokenized."""
        while True:
            n = 0
            for n, text in enumerate(sources.iter_documents(self.cfg), 1):
                if n > first:
                    yield epoch, n - 1, text
            if n == 0:
                raise ValueError(f"data.source={self.cfg.source!r} yields no documents")
            epoch, first = epoch + 1, 0

    def _fill(self, need: int) -> None:
        pieces = [self._buf]
        have = len(self._buf)
        while have < need:
            epoch, index, text = next(self._reader)
            self._next = (epoch, index + 1)
            ids = encode_documents(self.tokenizer, [text]).astype(np.int64)
            self._docs.append((epoch, index, len(ids)))
            pieces.append(ids)
            have += len(ids)
        self._buf = np.concatenate(pieces)

    def _drop(self, n: int) -> None:
        """Forget the first `n` tokens of the buffer, keeping track of the front document."""
        self._buf = self._buf[n:]
        self._used += n
        while self._docs and self._used >= self._docs[0][2]:
            self._used -= self._docs.popleft()[2]
