"""AdamW with 8-bit optimizer states, as a torch optimizer (`optim.name = adamw8bit`):
the arithmetic of quant/adam8bit.py (Dettmers et al. 2022) on each parameter."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardtrain.quant.blockwise import Quantized, dequantize, quantize_
from shardtrain.quant.adam8bit import adamw8bit_update, new_moments, state_bytes


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

    def canonical_state(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """p's moment `name` (exp_avg, exp_avg_sq) as an fp32 tensor of its shape, made
        when asked (checkpoints' layout-independent form, written one tensor at a time)."""
        state = self.state[p]
        if "m_codes" not in state:
            return state[name].view_as(p)
        short, signed = ("m", True) if name == "exp_avg" else ("v", False)
        return dequantize(Quantized(state[f"{short}_codes"], state[f"{short}_absmax"],
                                    signed)).view_as(p)

    @torch.no_grad()
    def load_canonical(self, states: dict[int, dict[str, torch.Tensor]], steps: int) -> None:
        """`states`: {index of the parameter in the groups' order: canonical_state's dict}."""
        params = [p for g in self.param_groups for p in g["params"]]
        for i, saved in states.items():
            p = params[i]
            state = self.state[p] = {"step": torch.tensor(float(steps)),
                                     **new_moments(p.numel(), p.device)}
            m, v = (saved[k].reshape(-1).float().to(p.device) for k in ("exp_avg", "exp_avg_sq"))
            if "m_codes" not in state:
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                continue
            quantize_(Quantized(state["m_codes"], state["m_absmax"], True), m)
            quantize_(Quantized(state["v_codes"], state["v_absmax"], False), v)

    def state_bytes(self) -> int:
        return sum(state_bytes(s) for s in self.state.values())
