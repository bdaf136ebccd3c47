"""The optimizer as the planner sees it: how many fp32 states it keeps per parameter, which
is the optimizer's share of ZeRO's K (bytes of optimizer state per parameter: the fp32
master, when the parameters are not their own, plus 4 per state; Rajbhandari et al. 2020).

Seed 002's taxonomy: vanilla SGD keeps no state, SGD with momentum one (the velocity),
AdaGrad one (the running sum of squared gradients), RMSProp one (their running average),
Adam two (m and v). The layout key `optim` names one of them; `momentum` and `sgd` are both
torch's SGD (optim.name = sgd), with optim.momentum > 0 and = 0. adamw8bit's 8-bit moments
are planned as adamw's (an over-estimate).
"""

from __future__ import annotations

from typing import Any

from shardtrain.config import OptimConfig

OPTIM_STATES = {"adamw": 2, "rmsprop": 1, "adagrad": 1, "momentum": 1, "sgd": 0}


def optim_fields(optim: str) -> dict[tuple[str, str], Any]:
    """(section, field) -> value of the training config for the layout's `optim` (none for
    adamw, the default: a preset's own adamw8bit stays)."""
    if optim == "adamw":
        return {}
    if optim == "sgd":
        return {("optim", "name"): "sgd", ("optim", "momentum"): 0.0}
    return {("optim", "name"): "sgd" if optim == "momentum" else optim}


def config_optim(optim: OptimConfig) -> str:
    """The layout's `optim` for a config's optimizer section (optim_fields' inverse)."""
    if optim.name == "sgd":
        return "momentum" if optim.momentum else "sgd"
    return "adamw" if optim.name == "adamw8bit" else optim.name
