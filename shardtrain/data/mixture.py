"""Which source each sequence of the global stream comes from, for a weighted mixture.

The global stream of sequences is cut into blocks of `block` positions. Every block holds
exactly `quota[s]` sequences of source s (the weights rounded by largest remainder), in an
order shuffled per block from (seed, block). So:

- the realised mixture is exact on every block (quota / block), not only in expectation;
- position p's source, and how many sequences of that source came before it (its index into
  that source's own shuffled windows), follow from p alone: any data-parallel layout sees
  the same sequences, and resuming needs only the step count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardtrain.config import ConfigError

BLOCK = 1000  # sequences per block: weights are realised to 0.1%


class Mixture:
    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK) -> None:
        w = np.asarray(weights, dtype=np.float64)
        exact = w / w.sum() * block
        quota = np.floor(exact).astype(np.int64)
        # Largest remainder: the leftover positions go to the largest fractional parts.
        order = np.argsort(-(exact - quota), kind="stable")
        quota[order[:block - int(quota.sum())]] += 1
        if (quota == 0).any():
            s = int(np.flatnonzero(quota == 0)[0])
            raise ConfigError(f"data.sources: weight {weights[s]} of source {s + 1} is below "
                             f"1/{block} of the total, so it would never be sampled; raise it")
        self.quota = quota  # [n_sources] sequences of each source per block
        self.block = block
        self.seed = seed
        self._cached = (-1, np.zeros(0, np.int64), np.zeros(0, np.int64))

    @property
    def fractions(self) -> list[float]:
        return (self.quota / self.block).tolist()

    def assign(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For global positions [first, first + count): the source of each, [count], and its
        index among that source's sequences so far, [count]."""
        source = np.empty(count, dtype=np.int64)
        index = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            b, offset = divmod(first + done, self.block)
            take = min(count - done, self.block - offset)
            pattern, earlier = self._pattern(b)
            src = pattern[offset:offset + take]
            source[done:done + take] = src
            index[done:done + take] = b * self.quota[src] + earlier[offset:offset + take]
            done += take
        return source, index

    def _pattern(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's sources in order, [block], and for each position the number of earlier
        positions in the block with the same source, [block]."""
        if self._cached[0] != b:  # one block cached: steps move forward through it
            labels = np.repeat(np.arange(len(self.quota)), self.quota)
            # A stream of its own (the third seed word): unrelated to the window shuffles.
            pattern = np.random.default_rng((self.seed, b, 0x6D6978)).permutation(labels)
            earlier = np.empty(self.block, dtype=np.int64)
            for s in range(len(self.quota)):
                at = np.flatnonzero(pattern == s)
                earlier[at] = np.arange(len(at))
            self._cached = (b, pattern, earlier)
        return self._cached[1], self._cached[2]
