"""NF4 storage of frozen base weights, with double quantization (Dettmers, Pagnoni, Holtzman
and Zettlemoyer 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", sec. 3).

NormalFloat4 has 16 levels, quantiles of N(0, 1) rescaled to [-1, 1]: 8 for the positive
half and 7 for the negative half taken at evenly spaced probabilities from 1/2 to
`OFFSET` = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2, plus an exact zero. Pretrained weights are
roughly normal, so each level is used about equally often. A weight is cut into blocks
of 64 values; each block is divided by its absolute maximum and every value stored as the
4-bit index of the nearest level, two per byte.

Double quantization: the fp32 block maxima (4 bytes per 64 values = 0.5 bits per
parameter) are themselves quantized: their mean is subtracted, and the rest is stored as
8-bit codes of the dynamic map in blocks of 256 (blockwise.py), leaving one fp32
scale per 256 x 64 values. Storage: 0.5 + 1/64 + 4/16384 bytes per parameter ~ 0.516.

`NF4Weight.dequantize` rebuilds the dense weight; `nf4_linear` multiplies by it without
keeping it: the backward dequantizes again (only the input gradient is needed, the base
weight being frozen), so the dense weight exists for one matmul at a time.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardtrain.quant.blockwise import Quantized, dequantize, quantize_

BLOCK = 64
OFFSET = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2


@functools.cache
def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels, sorted, from -1 to 1 with an exact 0."""
    normal_ppf = torch.special.ndtri
    pos = normal_ppf(torch.linspace(OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal_ppf(torch.linspace(OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).sort().values
    return (levels / levels.abs().max()).float()


@functools.cache
def _levels_on(device: torch.device) -> torch.Tensor:
    """`nf4_levels` on `device`, copied there once: `dequantize` runs in every forward and
    backward, and a host-to-device copy on each call is a transfer the host waits for."""
    return nf4_levels().to(device)


class NF4Weight(nn.Module):
    """A frozen weight of `shape` stored as NF4 (buffers, so they follow .to() and appear
    in the state dict: packed codes uint8 [n/2], the double-quantized block maxima as codes
    uint8 [n/64], their scales fp32 [ceil(n/64/256)] and their mean fp32 [])."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str | None = None):
        super().__init__()
        self.shape = tuple(shape)
        n = 1
        for d in shape:
            n *= d
        if n % BLOCK:
            raise ValueError(f"NF4 needs a multiple of {BLOCK} values; shape {list(shape)}")
        self.register_buffer("packed", torch.zeros(n // 2, dtype=torch.uint8, device=device))
        scales = Quantized.zeros(n // BLOCK, True, torch.device(device or "cpu"))
        self.register_buffer("scale_codes", scales.codes)
        self.register_buffer("scale_absmax", scales.absmax)
        self.register_buffer("scale_mean", torch.zeros((), device=device))

    def numel(self) -> int:
        return self.packed.numel() * 2

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> None:
        """Store `weight` (any float dtype, `shape`)."""
        blocks = weight.detach().float().reshape(-1, BLOCK).to(self.packed.device)  # [n/64, 64]
        absmax = blocks.abs().amax(dim=1)  # [n/64]
        normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        levels = _levels_on(normed.device)
        codes = torch.bucketize(normed, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
        codes = codes.view(-1, 2)
        self.packed.copy_(codes[:, 0] << 4 | codes[:, 1])
        mean = absmax.mean()
        self.scale_mean.copy_(mean)
        quantize_(self._scales(), absmax - mean)

    def _scales(self) -> Quantized:
        return Quantized(self.scale_codes, self.scale_absmax, True)

    def block_absmax(self) -> torch.Tensor:
        return dequantize(self._scales()) + self.scale_mean  # [n/64]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [shape] in `dtype`."""
        codes = torch.stack((self.packed >> 4, self.packed & 0xF), dim=1).view(-1, BLOCK)
        levels = _levels_on(self.packed.device)
        blocks = levels[codes.long()] * self.block_absmax()[:, None]  # [n/64, 64]
        return blocks.view(self.shape).to(dtype)


class _NF4Matmul(torch.autograd.Function):
    """x @ W.T with W dequantized in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
        ctx.weight = weight
        return x @ weight.dequantize(x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.weight.dequantize(grad.dtype), None


def nf4_linear(x: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] through a frozen NF4 weight [out, in]."""
    y = _NF4Matmul.apply(x, weight)
    return y if bias is None else y + bias
