"""The token group of a MoE layer's auxiliary losses when a micro-batch's tokens are split
over ranks: context parallelism gives each cp rank a slice of every sequence, sequence
parallelism each tp rank a chunk of its slice. The single-process run computes the
balance loss E * sum_i f_i P_i over the whole micro-batch (Fedus et al. 2021), so:

- f, the fraction of slots per expert, counts the whole group: the [E] routed counts are
  summed over tp (under sp) and cp (tag `moe_counts`; integers, no gradient);
- P (mean router probability) and the z-loss are means over this rank's tokens; the
  whole micro-batch's means are the average of the ranks' (equal slices). Under cp the
  replicas' gradients are averaged over dp x cp, which takes that average; under sp the
  router's and experts' gradient parts are summed over tp (their placement is `partial`),
  so each rank weights its auxiliary losses by 1 / tp (`MoE.aux_scale`).

Expert capacity, where set, applies to each rank's own tokens: under cp or sp a slice of
the micro-batch (docs/moe.md, "Token groups").
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.model.moe import MoE


def apply_token_groups(model: nn.Module, tp: Communicator, cp: Communicator, *,
                       sp: bool) -> None:
    """Give every MoE layer of `model` its group's counts and its auxiliary-loss weight."""
    comms = [c for c in ((tp if sp else None), cp) if c is not None and c.size > 1]
    if not comms:
        return

    def group_counts(routed: torch.Tensor) -> torch.Tensor:
        total = routed.clone()  # [E] int64
        for comm in comms:
            comm.all_reduce(total, "sum", tag="moe_counts")
        return total

    for module in model.modules():
        if isinstance(module, MoE):
            module.group_counts = group_counts
            module.aux_scale = 1.0 / tp.size if sp else 1.0
