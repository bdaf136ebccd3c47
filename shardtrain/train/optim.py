"""Optimizers (AdamW, AdamW with 8-bit states, SGD with or without momentum, RMSProp,
AdaGrad: seed 002's taxonomy, 2, 2, 1 or 0, 1 and 1 states per parameter) and the
learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtrain.config import OptimConfig
from shardtrain.train.adam8bit import AdamW8bit


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """Weight decay on matrices only; norms, biases (1-D tensors) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
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


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to base_lr * min_ratio at `total`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cosine)
