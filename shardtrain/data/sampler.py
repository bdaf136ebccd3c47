"""Deterministic, resumable batches of token windows, split across data-parallel ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardtrain.data.mixture import Mixture

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each [batch, seq_len] int64


class TokenSampler:
    """Windows of `seq_len + 1` tokens at stride `seq_len`, shuffled per epoch.

    Step k's global batch is positions [k*G, (k+1)*G) of the concatenation of the epochs'
    permutations; rank r takes the contiguous r-th 1/dp of it, so the ranks' batches
    concatenated in rank order equal the dp_size=1 batch.

    With several token streams (a mixture, `weights` one per stream), each stream has its
    own per-epoch shuffle and data/mixture.py says which stream each global position draws
    from and its index there: still a function of the position alone.
    """

    def __init__(self, tokens: np.ndarray | Sequence[np.ndarray], *, seq_len: int,
                 global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
                 weights: Sequence[float] | None = None) -> None:
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global_batch={global_batch} is not divisible by micro_batch="
                             f"{micro_batch} x dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        streams = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        mixed = len(streams) > 1
        self.windows = [_Windows(t, seq_len, (seed, s) if mixed else (seed,))
                        for s, t in enumerate(streams)]
        # An int for one stream (as checkpoints written before mixtures hold), else a list.
        self.n_windows: int | list[int] = ([w.n for w in self.windows] if mixed
                                           else self.windows[0].n)
        self.mixture = Mixture(weights or [1.0] * len(streams), seed) if mixed else None
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0  # global batches consumed

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""
        per_rank = self.global_batch // self.dp_size
        first = self.step * self.global_batch + self.dp_rank * per_rank
        self.step += 1
        if self.mixture is None:
            ids = self.windows[0].ids(np.arange(first, first + per_rank))  # [per_rank]
            windows = _windows(self.windows[0].tokens, ids * self.seq_len, self.seq_len)
        else:
            source, index = self.mixture.assign(first, per_rank)  # [per_rank] each
            windows = np.empty((per_rank, self.seq_len + 1), dtype=np.int64)
            for s, w in enumerate(self.windows):
                rows = np.flatnonzero(source == s)
                if len(rows):
                    windows[rows] = _windows(w.tokens, w.ids(index[rows]) * self.seq_len,
                                             self.seq_len)
        return [_split(windows[i:i + self.micro_batch])
                for i in range(0, per_rank, self.micro_batch)]

    def describe(self, names: Sequence[str], steps: int) -> str:
        """The realised mixture, one line per source: its share of every block of sequences
        and the epochs of it `steps` optimizer steps read."""
        if self.mixture is None:
            return ""
        lines = [f"data mixture (exact on every block of {self.mixture.block} sequences):"]
        for name, share, w in zip(names, self.mixture.fractions, self.windows):
            epochs = steps * self.global_batch * share / w.n
            lines.append(f"  {share:7.1%}  {name}  ({w.n} windows, {epochs:.2f} epochs "
                         f"over {steps} steps)")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
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


class _Windows:
    """One token stream's windows, shuffled per epoch from (seed words, epoch)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: tuple[int, ...]) -> None:
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seed = seed
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """Window indices at this stream's (non-decreasing) positions, across epoch ends."""
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


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, n_batches: int
                 ) -> list[Batch]:
    """`n_batches` batches of windows spread evenly over `tokens`; the same on every rank."""
    last_start = len(tokens) - (seq_len + 1)
    if last_start < 0:
        raise ValueError(f"the eval split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1}; raise data.eval_fraction or lower seq_len")
    starts = np.linspace(0, last_start, batch_size * n_batches).round().astype(np.int64)
    windows = _windows(tokens, starts, seq_len)
    return [_split(windows[i:i + batch_size]) for i in range(0, len(starts), batch_size)]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    # Fancy indexing reads only these windows' pages of a memmap, never the whole file.
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # [b, seq_len + 1]


def _split(windows: np.ndarray) -> Batch:
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()  # [b, seq_len] each
