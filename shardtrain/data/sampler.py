"""Deterministic, resumable batches of rows, split across data-parallel ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shardtrain.data.chat_rows import ChatRows
from shardtrain.data.mixture import Mixture
from shardtrain.data.rows import Batch, Rows, TextWindows, concat

Store = TextWindows | ChatRows


class TokenSampler:
    """Rows of `seq_len + 1` tokens -- windows at stride `seq_len` of a token stream, or
    chat rows (data/rows.py) -- shuffled per epoch.

    Step k's global batch is positions [k*G, (k+1)*G) of the concatenation of the epochs'
    permutations; rank r takes the contiguous r-th 1/dp of it, so the ranks' batches
    concatenated in rank order equal the dp_size=1 batch. `loss_tokens` is the number of
    counted targets in the last step's whole global batch, which every rank computes from
    the positions alone (no communication): the loss is averaged over it
    (parallel/pipeline/runtime.py).

    Replica groups (`groups` = parallel.replicas, parallel/replica/): the global batch is
    `groups` shares of G / groups rows, one per live group, each split over the group's
    dp ranks as above. `share(position, live)` sets the next step's: with `live` groups
    the step takes the next live x G / groups positions (the global batch shrinks), the
    group at `position` takes the position-th share. The state is the cursor (positions
    consumed), so no position is repeated or skipped: the share a lost group would have
    taken is the next step's first rows. With every group live this is the plain dp
    split over groups x dp_size ranks.

    With several streams (a mixture, `weights` one per stream), each stream has its own
    per-epoch shuffle and data/mixture.py says which stream each global position draws
    from and its index there: still a function of the position alone.
    """

    def __init__(self, tokens: np.ndarray | ChatRows | Sequence[np.ndarray | ChatRows], *,
                 seq_len: int, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int, weights: Sequence[float] | None = None,
                 eos_id: int | None = None, groups: int = 1) -> None:
        """`eos_id`: a text stream's document boundary, for data.document_mask."""
        if global_batch % (micro_batch * dp_size * groups):
            raise ValueError(f"global_batch={global_batch} is not divisible by micro_batch="
                             f"{micro_batch} x dp_size={dp_size} x groups={groups}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        streams = [tokens] if isinstance(tokens, (np.ndarray, ChatRows)) else list(tokens)
        mixed = len(streams) > 1
        self.stores: list[Store] = [TextWindows(t, seq_len, eos_id) if isinstance(t, np.ndarray)
                                    else t for t in streams]
        self.orders = [_Order(st.n, (seed, s) if mixed else (seed,))
                       for s, st in enumerate(self.stores)]
        # An int for one stream (as checkpoints written before mixtures hold), else a list.
        self.n_windows: int | list[int] = ([st.n for st in self.stores] if mixed
                                           else self.stores[0].n)
        self.mixture = Mixture(weights or [1.0] * len(streams), seed) if mixed else None
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0  # global batches consumed
        self.cursor = 0  # positions consumed (step x global_batch while every group lives)
        self.groups, self.position, self.live = groups, 0, groups
        self.loss_tokens = 0  # counted targets of the last step's global batch

    def share(self, position: int, live: int) -> None:
        """The next step's live replica groups and this group's place among them."""
        if not 0 <= position < live <= self.groups:
            raise ValueError(f"replica position {position} of {live} live groups "
                             f"(of {self.groups})")
        self.position, self.live = position, live

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""
        per_group = self.global_batch // self.groups
        g, per_rank = per_group * self.live, per_group // self.dp_size
        first = self.cursor
        self.step += 1
        self.cursor += g
        if self.mixture is None:
            source = np.zeros(g, dtype=np.int64)
            index = np.arange(first, first + g)
        else:
            source, index = self.mixture.assign(first, g)  # [G] each
        ids = np.empty(g, dtype=np.int64)  # each position's row in its stream
        self.loss_tokens = 0
        for s, (store, order) in enumerate(zip(self.stores, self.orders)):
            at = np.flatnonzero(source == s)
            ids[at] = order.ids(index[at])
            self.loss_tokens += store.counted(ids[at])
        lo = self.position * per_group + self.dp_rank * per_rank
        mine = slice(lo, lo + per_rank)
        rows = _gather(self.stores, source[mine], ids[mine])
        return [rows[i:i + self.micro_batch].batch() for i in range(0, per_rank, self.micro_batch)]

    def describe(self, names: Sequence[str], steps: int) -> str:
        """The realised mixture, one line per source: its share of every block of sequences
        and the epochs of it `steps` optimizer steps read."""
        if self.mixture is None:
            return ""
        lines = [f"data mixture (exact on every block of {self.mixture.block} sequences):"]
        for name, share, st in zip(names, self.mixture.fractions, self.stores):
            epochs = steps * self.global_batch * share / st.n
            lines.append(f"  {share:7.1%}  {name}  ({st.n} {st.unit}, {epochs:.2f} epochs "
                         f"over {steps} steps)")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_windows": self.n_windows,
                **({} if self.mixture is None else {"quota": self.mixture.quota.tolist()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the stream's geometry must match the saved one."""
        now = self.state_dict()
        for key in ("seed", "seq_len", "global_batch", "n_windows", "quota"):
            if state.get(key) != now.get(key):
                raise ValueError(
                    f"data sampler resume mismatch: {key} was {state.get(key)} in the checkpoint "
                    f"but is {now.get(key)} now (n_windows changes with the corpus or seq_len, "
                    "quota with data.sources' weights); resume with the original data and "
                    "batch settings")
        self.step = int(state["step"])
        self.cursor = int(state.get("cursor", self.step * self.global_batch))


class _Order:
    """One stream's rows in a shuffled order per epoch, from (seed words, epoch)."""

    def __init__(self, n: int, seed: tuple[int, ...]) -> None:
        self.n = n
        self.seed = seed
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """Row indices at this stream's (non-decreasing) positions, across epoch ends."""
        epoch, offset = np.divmod(positions, self.n)
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epoch):
            at = epoch == e
            out[at] = self._permutation(int(e))[offset[at]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # one epoch cached: steps move forward through it
            self._perm = np.random.default_rng((*self.seed, epoch)).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm


def _gather(stores: list[Store], source: np.ndarray, ids: np.ndarray) -> Rows:
    """Row ids[i] of stream source[i], for each i, in order."""
    if len(stores) == 1:
        return stores[0].take(ids)
    parts = [(np.flatnonzero(source == s), st) for s, st in enumerate(stores)]
    parts = [(at, st.take(ids[at])) for at, st in parts if len(at)]
    rows = concat([r for _, r in parts])
    order = np.argsort(np.concatenate([at for at, _ in parts]), kind="stable")
    return Rows(rows.tokens[order], *(None if a is None else a[order]
                                      for a in (rows.counted, rows.starts)))


def eval_batches(data: np.ndarray | ChatRows, *, seq_len: int, batch_size: int,
                 n_batches: int, eos_id: int | None = None) -> list[Batch]:
    """`n_batches` batches of rows spread evenly over the held-out set (a token stream, or
    chat rows); the same on every rank. `eos_id`: as TokenSampler's."""
    if isinstance(data, np.ndarray):
        if len(data) < seq_len + 1:
            raise ValueError(f"the eval split has {len(data)} tokens, fewer than seq_len + 1 = "
                             f"{seq_len + 1}; raise data.eval_fraction or lower seq_len")
        data = TextWindows(data, seq_len, eos_id)
    rows = data.spread(batch_size * n_batches)
    return [rows[i:i + batch_size].batch() for i in range(0, batch_size * n_batches, batch_size)]
