"""AdamW with 8-bit optimizer states (Dettmers, Lewis, Shleifer and Zettlemoyer 2022,
"8-bit Optimizers via Block-wise Quantization").

Adam's two moments are stored as one byte per element: each block of 256 consecutive
elements is divided by its absolute maximum (kept in fp32) and rounded to the nearest of
256 levels of a *dynamic* quantization map. Each step dequantizes the moments to fp32,
applies the ordinary AdamW update, and quantizes them again; the parameters themselves
stay in their own precision. Tensors with fewer than 4096 elements (norms, biases) keep
fp32 moments: their memory is negligible and they are sensitive.

The dynamic map (Dettmers 2016; sec. 2 of the 2022 paper): after an optional sign bit,
the number of leading zero bits e gives the decade 10^-e of the value, the first one bit
ends the exponent and the remaining bits are a linear fraction in [0.1, 1]. So the
largest decade [0.1, 1] gets the most levels (64 per sign signed, 128 unsigned), each
smaller decade half as many, down to 10^-7; with 0 and 1 that makes 256 levels. Small
values keep a relative precision that a linear int8 grid would lose, which matters for
the second moment (gradients squared span many decades). The first moment uses the signed
map, the second (never negative) the unsigned one, whose sign bit becomes one more
fraction bit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

BLOCK = 256
MIN_QUANTIZED_NUMEL = 4096


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted levels of the dynamic map, in [-1, 1] (signed) or [0, 1]."""
    levels = [0.0, 1.0]
    for k in range(7):  # decade 10^(k-6) .. 10^(k-7+1): k = 6 is [0.1, 1]
        n = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (k - 6)).tolist()
        levels += mids + ([-x for x in mids] if signed else [])
    out = torch.tensor(sorted(levels), dtype=torch.float32)
    assert out.numel() == 256
    return out


@functools.cache
def _boundaries(signed: bool) -> torch.Tensor:
    """Midpoints between consecutive levels [255]: rounding to the nearest level."""
    levels = dynamic_map(signed)
    return (levels[1:] + levels[:-1]) / 2


@dataclass
class Quantized:
    """A flat fp32 tensor [n] as codes uint8 [n] and absmax fp32 [ceil(n / BLOCK)]."""

    codes: torch.Tensor
    absmax: torch.Tensor
    signed: bool

    @staticmethod
    def zeros(n: int, signed: bool, device: torch.device) -> Quantized:
        zero = int(torch.searchsorted(dynamic_map(signed), 0.0))  # the code of 0.0
        return Quantized(torch.full((n,), zero, dtype=torch.uint8, device=device),
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
    bounds = _boundaries(q.signed).to(x.device)
    q.codes.copy_(torch.bucketize(normed, bounds).view(-1)[: x.numel()])
    q.absmax.copy_(absmax)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values [n] that q stands for."""
    levels = dynamic_map(q.signed).to(q.codes.device)
    values = levels[q.codes.long()]  # [n]
    return (_blocks(values) * q.absmax[:, None]).view(-1)[: q.codes.numel()]


def new_moments(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Zero Adam moments for a tensor of n elements, quantized where it is large enough."""
    if n < MIN_QUANTIZED_NUMEL:
        return {"exp_avg": torch.zeros(n, device=device),
                "exp_avg_sq": torch.zeros(n, device=device)}
    m, v = Quantized.zeros(n, True, device), Quantized.zeros(n, False, device)
    return {"m_codes": m.codes, "m_absmax": m.absmax, "v_codes": v.codes, "v_absmax": v.absmax}


@torch.no_grad()
def adamw8bit_update(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                     *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int) -> None:
    """One AdamW step of a flat fp32 tensor param [n] with grad [n] and its moments
    (`new_moments`), in place; `step` counts this step (bias correction)."""
    quantized = "m_codes" in state
    if quantized:
        mq = Quantized(state["m_codes"], state["m_absmax"], True)
        vq = Quantized(state["v_codes"], state["v_absmax"], False)
        exp_avg, exp_avg_sq = dequantize(mq), dequantize(vq)
    else:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    if weight_decay:  # decoupled (Loshchilov and Hutter 2019)
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if quantized:
        quantize_(mq, exp_avg)
        quantize_(vq, exp_avg_sq)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")


class AdamW8bit(torch.optim.Optimizer):
    """torch.optim-style AdamW whose moments are block-wise 8-bit (see the module doc).
    state_dict / load_state_dict round-trip the codes and scales exactly."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state.update(new_moments(p.numel(), p.device))
                state["step"] += 1
                flat = p.float().reshape(-1)  # p itself when fp32 and contiguous
                adamw8bit_update(flat, p.grad.float().view(-1), state, lr=group["lr"],
                                 beta1=beta1, beta2=beta2, eps=group["eps"],
                                 weight_decay=group["weight_decay"], step=int(state["step"]))
                if flat.data_ptr() != p.data_ptr():
                    p.copy_(flat.view_as(p))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim casts floating state to the parameter's dtype and leaves integer
        # tensors alone on some versions but not others: codes are bytes again either way
        # (0..255 survive a round trip through fp32 exactly).
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("m_codes", "v_codes"):
                if key in state:
                    state[key] = state[key].to(torch.uint8)

    def state_bytes(self) -> int:
        return sum(state_bytes(s) for s in self.state.values())
