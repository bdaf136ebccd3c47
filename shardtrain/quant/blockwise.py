"""Block-wise 8-bit quantization with the dynamic map (Dettmers, Lewis, Shleifer and
Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization", sec. 2; Dettmers 2016).

Each block of 256 consecutive values is divided by its absolute maximum (kept in fp32) and
rounded to the nearest of the 256 levels of the dynamic map (a nonzero value to the
smallest level of its sign at least, `_boundaries`): after an optional sign bit,
the number of leading zero bits e gives the decade 10^-e of the value, the first one bit
ends the exponent and the remaining bits are a linear fraction in [0.1, 1]. So the
largest decade [0.1, 1] gets the most levels (64 per sign signed, 128 unsigned), each
smaller decade half as many, down to 10^-7; with 0 and 1 that makes 256 levels. Small
values keep a relative precision that a linear int8 grid would lose. The unsigned map
(for values never negative) spends the sign bit on one more fraction bit.

Pure tensor code: used by the 8-bit optimizer (adam8bit.py), ZeRO's shard of it
(parallel/zero/optim8bit.py) and NF4's double quantization (nf4.py).
"""


from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 256


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted levels of the dynamic map, in [-1, 1] (signed) or [0, 1].

    The signed map has -1 as well as 1 (in place of its smallest negative level, -5.5e-7):
    a block's largest magnitude then always lands on a level of magnitude 1, so quantizing
    dequantized values gives back the same codes and scales (checkpoints store moments
    dequantized, parallel/pieces.py)."""
    levels = [0.0, 1.0] + ([-1.0] if signed else [])
    for k in range(7):  # decade 10^(k-6) .. 10^(k-7+1): k = 6 is [0.1, 1]
        n = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (k - 6)).tolist()
        levels += mids + ([-x for x in mids if k > 0] if signed else [])
    out = torch.tensor(sorted(levels), dtype=torch.float32)
    assert out.numel() == 256
    return out


@functools.cache
def _zero_code(signed: bool) -> int:
    """The code of 0.0."""
    return int(torch.searchsorted(dynamic_map(signed), 0.0))


@functools.cache
def _boundaries(signed: bool) -> torch.Tensor:
    """The upper edge of each level's bucket but the last [255]: the midpoints between
    consecutive levels (rounding to the nearest), except that 0's bucket holds 0 alone, so
    a nonzero value takes at least the smallest level of its sign. A second moment stored
    as 0 leaves the next step's v = (1 - beta2) g^2 of that step alone, and the update
    m / sqrt(v) is unbounded where g is near 0 and m is not; it happens where a block's
    gradients span more than 3.5 decades (v spans twice as many, past the map's 7). For
    the first moment it keeps the sign (as bitsandbytes' kernel does)."""
    levels = dynamic_map(signed)
    bounds = (levels[1:] + levels[:-1]) / 2
    zero = _zero_code(signed)
    bounds[zero] = 0.0  # bucketize: bounds[i - 1] < x <= bounds[i] gives level i
    if signed:  # the negative float nearest 0: every x < 0 is at most it
        bounds[zero - 1] = torch.nextafter(torch.tensor(0.0), torch.tensor(-1.0))
    return bounds


@functools.cache
def _table(levels: bool, signed: bool, device: torch.device) -> torch.Tensor:
    """The map's levels [256] (levels=True) or `_boundaries` [255] on `device`, copied there
    once: quantizing runs per tensor and per step, and a host-to-device copy on each call
    would be a transfer from pageable memory that the host waits for."""
    return (dynamic_map(signed) if levels else _boundaries(signed)).to(device)


@dataclass
class Quantized:
    """A flat fp32 tensor [n] as codes uint8 [n] and absmax fp32 [ceil(n / BLOCK)]."""

    codes: torch.Tensor
    absmax: torch.Tensor
    signed: bool

    @staticmethod
    def zeros(n: int, signed: bool, device: torch.device) -> Quantized:
        return Quantized(torch.full((n,), _zero_code(signed), dtype=torch.uint8, device=device),
                         torch.zeros(-(-n // BLOCK), device=device), signed)

    def nbytes(self) -> int:
        return self.codes.numel() + self.absmax.numel() * self.absmax.element_size()


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[n] -> [n_blocks, BLOCK], the last block padded with zeros."""
    pad = -x.numel() % BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def quantize_(q: Quantized, x: torch.Tensor) -> None:
    """Store the fp32 values x [n] into q, block by block."""
    blocks = _blocks(x.float())  # [n_blocks, BLOCK]
    absmax = blocks.abs().amax(dim=1)  # [n_blocks]
    normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    bounds = _table(False, q.signed, x.device)
    q.codes.copy_(torch.bucketize(normed, bounds).view(-1)[: x.numel()])
    q.absmax.copy_(absmax)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values [n] that q stands for."""
    levels = _table(True, q.signed, q.codes.device)
    values = levels[q.codes.long()]  # [n]
    return (_blocks(values) * q.absmax[:, None]).view(-1)[: q.codes.numel()]


