"""How context parallelism cuts a sequence over the cp ranks: contiguous or zig-zag chunks.

Contiguous: N equal chunks, rank r holds chunk r. Under causal attention the last rank's
queries see the whole sequence and the first rank's only its own chunk, so the ranks'
attention work grows with r (r + 1 blocks of the ring: see blocks.py).
Zig-zag (head-tail): 2N chunks, rank r holds chunk r and chunk 2N-1-r, one from the cheap
head and one from the expensive tail, so every rank does the same causal work. Brandon et
al. 2023 ("Striped Attention") describe this imbalance of causal ring attention and balance
it by striping tokens round-robin; the head-tail split balances it at chunk granularity,
which keeps each chunk a contiguous run of positions (one mask rule per chunk pair).

Under packed documents (data.document_mask) causal work follows the documents, not the
row: a token sees only its own document's earlier tokens. The zig-zag split then pairs its
2N chunks by that work, per batch (balance.py); one document per row gives the head-tail
pairs above. `assignment` holds such a pairing.

Chunks are ascending runs of positions and a rank's local tokens are its chunks
concatenated in chunk order; `positions` says which global position each local token has
(RoPE, the loss mask and Ulysses' reordering read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtrain.config.errors import ConfigError


@dataclass(frozen=True)
class SequenceSplit:
    seq_len: int  # the full sequence S
    cp: int  # the number of ranks N that share it
    zigzag: bool  # True: 2N chunks, rank r holds r and 2N-1-r; False: N, rank r holds r
    # Per rank, its chunk ids (ascending) where they are not the fixed pairs above: the
    # documents' balance (balance.py); None: the fixed pairs.
    assignment: tuple[tuple[int, ...], ...] | None = None

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.n_chunks

    @property
    def local_len(self) -> int:
        """Tokens each rank holds: S / N."""
        return self.seq_len // self.cp

    def check(self) -> None:
        """ConfigError (a ValueError) when the sequence does not cut into equal chunks."""
        if self.cp < 1:
            raise ConfigError(f"parallel.cp={self.cp} must be >= 1")
        if self.seq_len < 1 or self.seq_len % self.n_chunks:
            kind = f"2 x parallel.cp = {self.n_chunks} (zig-zag split)" if self.zigzag \
                else f"parallel.cp = {self.cp}"
            raise ConfigError(
                f"train.seq_len={self.seq_len} must be a positive multiple of {kind}; "
                f"pick a sequence length divisible by it or change parallel.cp={self.cp}")

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunk ids rank holds, in local order (ascending)."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} is outside the cp group of {self.cp}")
        if self.assignment is not None:
            return self.assignment[rank]
        return (rank, 2 * self.cp - 1 - rank) if self.zigzag else (rank,)

    def positions(self, rank: int, device: torch.device | str) -> torch.Tensor:
        """int64 [S/N]: the global position of each token rank holds, in local order."""
        c = self.chunk_len
        return torch.cat([torch.arange(i * c, (i + 1) * c, dtype=torch.int64, device=device)
                          for i in self.chunks(rank)])

    def order(self, device: torch.device | str) -> torch.Tensor:
        """int64 [S]: global positions of every rank's tokens, rank after rank (the order a
        gather over the cp ranks produces)."""
        return torch.cat([self.positions(r, device) for r in range(self.cp)])

    def take(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """rank's slice of a full-sequence tensor along `dim` (e.g. tokens [B, S] ->
        [B, S/N]); differentiable (narrow + cat)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"take: dim {dim} of a tensor of shape {tuple(x.shape)} is not "
                             f"the full sequence train.seq_len={self.seq_len}")
        c = self.chunk_len
        parts = [x.narrow(dim, i * c, c) for i in self.chunks(rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
