"""Variants of a ranked layout that change only its data-parallel group's ops (so the search
prices them only where they could enter the top: search.py `with_variants`), fastest first.

- Unsharded accumulation (parallel.zero_accumulate, plan/accumulate.py): a ZeRO-2 or 3
  layout without a pipeline (under one it is what already runs) whose replicas accumulate
  several micro-batches sends one micro-batch's bytes per step and holds the stage's full
  gradient (ZeRO-3 also its parameters) through the step.
- ZeRO++ (plan/zeropp.py), asked for: its int8 weights and gradients change the numbers.
"""

from __future__ import annotations

import dataclasses

from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import replicas_per_node


def variants(layout: Layout, *, node_size: int, zeropp: bool) -> list[list[Layout]]:
    """Groups of alternatives, each fastest first (the search keeps one of each group)."""
    return [accumulate_variants(layout)] + ([zeropp_variants(layout, node_size=node_size)]
                                            if zeropp else [])


def accumulate_variants(layout: Layout) -> list[Layout]:
    """The unsharded-accumulation variant of a ZeRO-2/3 layout that accumulates over
    replicas without a pipeline (module docstring), or none."""
    lay = layout
    if (lay.zero < 2 or lay.pp > 1 or lay.microbatches < 2 or lay.replicas < 2
            or lay.accumulate == "unsharded"):
        return []
    return [dataclasses.replace(lay, accumulate="unsharded")]


def zeropp_variants(layout: Layout, *, node_size: int) -> list[Layout]:
    """ZeRO++ (plan/zeropp.py) for a ZeRO-3 layout whose replica group spans nodes, where
    its bytes cross the slow links: qwZ + hpZ + qgZ, then qwZ + qgZ (no secondary shard's
    memory; the only one under a pipeline, where the trainer refuses hpZ)."""
    lay = layout
    if lay.zero != 3 or lay.qwz or lay.replicas <= replicas_per_node(lay, node_size):
        return []
    light = dataclasses.replace(lay, qwz=True, qgz=True)
    return ([dataclasses.replace(light, hpz=True)] if lay.pp == 1 else []) + [light]


