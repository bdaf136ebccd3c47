"""Deterministic, resumable batches of token windows, split across data-parallel ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each [batch, seq_len] int64


class TokenSampler:
    """Windows of `seq_len + 1` tokens at stride `seq_len`, shuffled per epoch.

    Step k's global batch is positions [k*G, (k+1)*G) of the concatenation of the epochs'
    permutations; rank r takes the contiguous r-th 1/dp of it, so the ranks' batches
    concatenated in rank order equal the dp_size=1 batch.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global_batch={global_batch} is not divisible by micro_batch="
                             f"{micro_batch} x dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0  # global batches consumed
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""
        per_rank = self.global_batch // self.dp_size
        first = self.step * self.global_batch + self.dp_rank * per_rank
        ids = self._window_ids(first, per_rank)  # [per_rank]
        self.step += 1
        starts = ids * self.seq_len
        return [_gather(self.tokens, starts[i:i + self.micro_batch], self.seq_len)
                for i in range(0, per_rank, self.micro_batch)]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_windows": self.n_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the stream's geometry must match the saved one."""
        for key in ("seed", "seq_len", "global_batch", "n_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data sampler resume mismatch: {key} was {state[key]} in the checkpoint but "
                    f"is {getattr(self, key)} now (n_windows changes with the corpus or seq_len); "
                    "resume with the original data and batch settings")
        self.step = int(state["step"])

    def _window_ids(self, first: int, count: int) -> np.ndarray:
        """Window indices at stream positions [first, first + count), across epoch ends."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(first + done, self.n_windows)
            take = min(count - done, self.n_windows - offset)
            out[done:done + take] = self._permutation(epoch)[offset:offset + take]
            done += take
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # one epoch cached: steps move forward through it
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.n_windows)
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
    return [_gather(tokens, starts[i:i + batch_size], seq_len)
            for i in range(0, len(starts), batch_size)]


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    # Fancy indexing reads only these windows' pages of a memmap, never the whole file.
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)]  # [b, seq_len + 1]
    windows = torch.from_numpy(windows.astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # [b, seq_len] each
