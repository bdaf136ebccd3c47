"""Range checks for the single fields no section's own `validate` covers, and a finiteness
check over every float field of every section.

Each section's `validate` checks the fields whose rule involves another field (a head count
that divides the width, a batch that divides over dp); what is left are bounds on one value,
kept here as a table so a new float field is covered by the non-finite check without a line
of its own. A NaN compares false with everything, so `lr <= 0` lets it through: without
this check `--train.lr nan` reached torch's optimizer, and `--train.lr inf` trained to a
NaN loss at step 2 (issue 34).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any

from shardtrain.config.errors import ConfigError

# "section.field": (the rule in words, a test of the value)
RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model.norm_eps": ("> 0", lambda v: v > 0),
    "model.rope_theta": ("> 0", lambda v: v > 0),
    "model.ffn_dim": (">= 0 (0: the style's default width)", lambda v: v >= 0),
    "optim.beta1": ("in [0, 1)", lambda v: 0 <= v < 1),
    "optim.beta2": ("in [0, 1)", lambda v: 0 <= v < 1),
    "optim.eps": ("> 0", lambda v: v > 0),
    "optim.weight_decay": (">= 0", lambda v: v >= 0),
    "optim.momentum": ("in [0, 1)", lambda v: 0 <= v < 1),
    "optim.rms_alpha": ("in [0, 1)", lambda v: 0 <= v < 1),
    "optim.adagrad_lr_decay": (">= 0", lambda v: v >= 0),
    "train.eval_every": (">= 0 (0: only at the end)", lambda v: v >= 0),
    "train.sample_tokens": (">= 0 (0: no sample)", lambda v: v >= 0),
    "train.sample_max_params": (">= 0 (0: sample only where every rank holds whole layers)",
                                lambda v: v >= 0),
    "train.peak_flops": (">= 0 (0: from the device)", lambda v: v >= 0),
}


@functools.cache
def _float_fields(cls: type) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(section, its float fields) of a Config class: read once (the planner validates
    configs by the hundred thousand, plan/layout.py)."""
    out = []
    for section in dataclasses.fields(cls):
        inner = typing.get_type_hints(cls)[section.name]
        names = tuple(f.name for f in dataclasses.fields(inner)
                      if typing.get_type_hints(inner)[f.name] is float)
        out.append((section.name, names))
    return tuple(out)


_RULES = [(*key.split("."), key, rule, ok) for key, (rule, ok) in RANGES.items()]


def check_finite(cfg: Any) -> None:
    """Every float field of every section is a finite number."""
    for section, names in _float_fields(type(cfg)):
        obj = getattr(cfg, section)
        for name in names:
            value = getattr(obj, name)
            if not math.isfinite(value):
                raise ConfigError(f"{section}.{name}={value} is not a finite number; "
                                  "give a finite value")


def check_ranges(cfg: Any) -> None:
    """Non-finite floats, then each bound of RANGES; the message names the field and rule."""
    check_finite(cfg)
    for section, name, key, rule, ok in _RULES:
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ConfigError(f"{key}={value!r} must be {rule}; change --{key}")
