"""The arithmetic of AdamW with 8-bit states (Dettmers et al. 2022): Adam's two moments
stored block-wise quantized (blockwise.py; signed map for the first moment, unsigned for
the second), dequantized to fp32 for each step's update and quantized again. Tensors with
fewer than 4096 elements (norms, biases) keep fp32 moments: their memory is negligible and
they are sensitive. Shared by train/adam8bit.py (a torch optimizer) and
parallel/zero/optim8bit.py (ZeRO's shards).
"""

from __future__ import annotations

import torch

from shardtrain.quant.blockwise import Quantized, dequantize, quantize_

MIN_QUANTIZED_NUMEL = 4096


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


