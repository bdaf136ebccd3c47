"""Where each token sits: the RoPE tables (Su et al. 2021) and their frequency scalings,
the rows of the position tables a batch reads, and the attention mask of packed documents.

Packed documents (data.document_mask): each row of a batch holds several documents, and
the batch carries `positions` [B, S], each document's tokens numbered from 0. A token
attends only to the earlier tokens of its own document (`Documents`: the spans, from which
attention runs per document, never an [S, S] mask), and RoPE or the learned positions see
the position inside the document, so a document computes exactly what it would alone
(tests/test_document_mask.py). Under context parallelism every cp rank gets the full rows'
positions: its documents' spans cross the split, and RoPE reads the positions it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.config import ModelConfig


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [S, D/2] for rotary position embeddings (Su et al. 2021), pair i
    turning at theta^(-2i/D) per position, scaled as `cfg.rope_scaling` says."""
    d = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64),
                         scale_frequencies(inv_freq, cfg))
    scale = yarn_attention_factor(cfg) if cfg.rope_scaling == "yarn" else 1.0
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's scale of cos and sin (so of q.k by its square): 0.1 ln(factor) + 1 unless
    the checkpoint states one (Peng et al. 2023, eq. 21)."""
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0


def scale_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """linear: every frequency / factor (position interpolation, Chen et al. 2023). llama3
    (Llama 3.1's release): wavelengths shorter than original_max_len / high_freq_factor kept,
    longer than original_max_len / low_freq_factor divided by factor, those between blended
    linearly in original_max_len / wavelength. dynamic (NTK-aware, as transformers runs it):
    theta grows only for sequences beyond max_seq_len, which train.seq_len never is, so
    the frequencies are the plain ones."""
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling in ("none", "dynamic"):
        return inv_freq
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(inv_freq, cfg)
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (cfg.rope_original_max_len / wavelen - low) / (high - low)  # 0 at low, 1 at high
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > cfg.rope_original_max_len / low, inv_freq / factor, inv_freq)
    between = (wavelen >= cfg.rope_original_max_len / high) & \
        (wavelen <= cfg.rope_original_max_len / low)
    return torch.where(between, blended, out)


def yarn_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): pairs that turn
    more than beta_fast = 32 times over the original context keep their frequency, those
    turning fewer than beta_slow = 1 times are divided by the factor, a linear ramp in the
    pair index between (bounds floored and ceiled, as transformers' truncate=True)."""
    d, orig = cfg.rope_dim, cfg.rope_original_max_len

    def pair_of(rotations: float) -> float:  # the pair index turning `rotations` times
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = max(math.floor(pair_of(32)), 0), min(math.ceil(pair_of(1)), d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x [B, S, H, D] by position; cos/sin are [S, D/2], or
    [B, S, D/2] where each sequence has positions of its own (packed documents)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [(B,) S, 1, D/2]: broadcast over heads
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def position_index(module: nn.Module, seq_len: int, positions: torch.Tensor | None = None,
                   documents: Documents | None = None) -> torch.Tensor | slice:
    """Where the rows of the position tables (RoPE, GPT-2's learned positions) for the
    `seq_len` tokens in hand are: `positions` [B, S] (packed documents, their spans
    `documents`) when given (under context parallelism the full rows', of which the
    module's `held_for(documents)` says which are held: the split balances its chunks by
    the documents), else the module's `positions` [S] when set (context parallelism), else
    0..S-1."""
    held = getattr(module, "positions", None)
    if positions is not None:  # under cp the full rows' positions: the ones held, [B, S/N]
        if held is None:
            return positions
        pick = getattr(module, "held_for", None)
        if pick is not None and documents is not None:
            held = pick(documents)
        return positions.index_select(1, held)
    positions = held
    if positions is None:
        return slice(0, seq_len)
    if positions.shape[0] != seq_len:
        raise ValueError(f"{seq_len} tokens in hand but {positions.shape[0]} positions set")
    return positions


def position_ids(module: nn.Module, seq_len: int, positions: torch.Tensor | None,
                 device: torch.device, documents: Documents | None = None) -> torch.Tensor:
    """`position_index` as ids, [S] or [B, S]: the input of GPT-2's position embedding, which
    is called as a module (layouts hook its forward: a parameter server's pull waits there)."""
    at = position_index(module, seq_len, positions, documents)
    return torch.arange(seq_len, device=device) if isinstance(at, slice) else at


@dataclass(frozen=True)
class Documents:
    """Where the packed documents of each row of a batch lie: `spans[b]`, the [start, end)
    token ranges of row b's documents, ascending and covering 0..S. Host-side ints, so
    attention runs one fused causal kernel per document (model/attention.py) or per
    document's share of a chunk pair (parallel/context/), with no [S, S] mask made."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    seq_len: int  # S: the full row, whatever part of it a rank holds

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> Documents:
        """From each token's position in its document, [B, S]: a document starts wherever
        its position is 0 (and at token 0). One device-to-host copy of the starts."""
        b, s = positions.shape
        starts = positions == 0
        starts[:, 0] = True
        rows, cols = starts.nonzero().t().tolist()  # ascending, row by row
        per_row: list[list[int]] = [[] for _ in range(b)]
        for r, c in zip(rows, cols):
            per_row[r].append(c)
        return cls(tuple(tuple(zip(row, row[1:] + [s])) for row in per_row), s)

