"""Optimizers (AdamW, AdamW with 8-bit states, SGD with or without momentum, RMSProp,
AdaGrad: seed 002's taxonomy, 2, 2, 1 or 0, 1 and 1 states per parameter), their 16-bit
form (bf16-true, fp16-true: `Optimizer16`) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtrain.config import OptimConfig
from shardtrain.parallel.true16 import round_seed, update_16bit
from shardtrain.parallel.zero.optim import moment_names, update_shard
from shardtrain.train.adam8bit import AdamW8bit

STEP_HOME = torch.device("cpu")  # where torch keeps a non-fused optimizer's step count


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float,
                    seed: int = 0) -> torch.optim.Optimizer:
    """Weight decay on matrices only; norms, biases (1-D tensors) are not decayed. 16-bit
    trainable parameters (train.precision bf16-true, fp16-true) get `Optimizer16`; `seed`
    seeds its stochastic rounding."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return Optimizer16(groups, cfg, lr=lr, seed=seed)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 **adamw_kernel(params))
    if cfg.name == "adamw8bit":
        return AdamW8bit(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.name == "rmsprop":  # Tieleman and Hinton 2012
        return torch.optim.RMSprop(groups, lr=lr, alpha=cfg.rms_alpha, eps=cfg.eps)
    if cfg.name == "adagrad":  # Duchi et al. 2011
        return torch.optim.Adagrad(groups, lr=lr, lr_decay=cfg.adagrad_lr_decay, eps=cfg.eps)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch's fused AdamW (one kernel for every tensor of the step) where every parameter
    is on a GPU; torch's default elsewhere (foreach on CPU), so the CPU runs keep their
    numbers. The update's arithmetic is AdamW's either way; fused rounds differently in the
    last bits (fused multiply-adds) and keeps its step count on the device."""
    return {"fused": True} if params and all(p.is_cuda for p in params) else {}


class Optimizer16(torch.optim.Optimizer):
    """The replicated layouts' optimizer of 16-bit parameters (parallel/true16.py): each
    step widens one parameter to fp32, applies ZeRO's fp32 arithmetic (zero/optim.py
    `update_shard`, torch.optim's single-tensor step) with fp32 moments held by their torch
    names, and writes it back rounded by optim.bf16_update. Kahan's compensation is a
    state of the parameter's own dtype; checkpoints keep it beside the moments."""

    def __init__(self, groups: list[dict], optim: OptimConfig, *, lr: float, seed: int):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})
        self.optim, self.seed, self.names = optim, seed, moment_names(optim)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts every floating state to its parameter's dtype as it loads: the
        moments are put back in fp32 from the given ones (`state` keyed by parameter index,
        torch's form), the compensation in the parameter's dtype."""
        given = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in given.items():
            p = params[index]
            for key, value in saved.items():
                if key != "step":
                    dtype = p.dtype if key == "compensation" else torch.float32
                    self.state[p][key] = value.to(dtype=dtype, device=p.device)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        index = 0  # the parameter's place: the same on every replica (stochastic's seed)
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]  # each state made at first use (a checkpoint of
                # another optim.bf16_update has no compensation): moments fp32 [p.shape],
                # the compensation in p's dtype, the step on the host as torch keeps it
                state.setdefault("step", torch.zeros((), device=STEP_HOME))
                for n in self.names:
                    if n not in state:
                        state[n] = torch.zeros_like(p, dtype=p.dtype if n == "compensation"
                                                    else torch.float32)
                state["step"] += 1
                steps = int(state["step"])
                moments = [state[n].view(-1) for n in self.names if n != "compensation"]
                decay = [(0, p.numel())] if group["weight_decay"] else []
                comp = state.get("compensation")

                def fp32_step(w: torch.Tensor, moments=moments, grad=p.grad, decay=decay,
                              lr=group["lr"], steps=steps) -> None:
                    update_shard(w, moments, grad.reshape(-1).float(), decay, lr, steps,
                                 self.optim)
                update_16bit(p.view(-1), fp32_step, mode=self.optim.bf16_update,
                             seed=round_seed(self.seed, steps, index),
                             compensation=None if comp is None else comp.view(-1))


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to base_lr * min_ratio at `total`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)
