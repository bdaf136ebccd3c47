"""Layouts evaluated after the search's grid, as variants of the fitting plans that could
then rank in the top:

- ZB-V and DualPipeV (two chunks per stage in a V) of a ZB-H1 layout: another bubble and
  activation peak, the embedding and head both on stage 0.
- Unsharded accumulation (parallel.zero_accumulate, plan/accumulate.py): a ZeRO-2 or 3
  layout without a pipeline (under one it is what already runs) whose replicas accumulate
  several micro-batches sends one micro-batch's bytes per step and holds the stage's full
  gradient (ZeRO-3 also its parameters) through the step.
- ZeRO++ (plan/zeropp.py), asked for: its int8 weights and gradients change the numbers.

Each kind changes one part of the step, so a variant is never faster than its plan less
that part's seconds: the V only the pipeline's schedule, whose best is no bubble at all
(bound: the plan's bubble); accumulation and ZeRO++ only the dp group's ops (bound: the
plan's exposed dp communication). The bound spares evaluating the rest; pricing every V
layout in the grid would add a third of its candidates. The kinds run one after another,
so a V layout can take ZeRO++ too. Each variant still goes through the trainer's config
validation (`trainer_refusal`), so none the trainer refuses is proposed.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable

from shardtrain.config import DataConfig, ModelConfig
from shardtrain.cost.hardware import Hardware
from shardtrain.plan.evaluate import Plan, dp_exposed_s, evaluate, fits
from shardtrain.plan.layout import Layout, trainer_refusal
from shardtrain.plan.memory import memory_per_gpu, replicas_per_node

# (plan, node size) -> (variants in order of preference, the plan's step seconds a variant
# can save at most, whether the first fitting variant is the only one kept)
Variants = Callable[[Plan, int], tuple[list[Layout], float, bool]]


def zeropp_variants(plan: Plan, node_size: int) -> tuple[list[Layout], float, bool]:
    """ZeRO++ (plan/zeropp.py) for a ZeRO-3 layout whose replica group spans nodes, where
    its bytes cross the slow links: qwZ + hpZ + qgZ, then qwZ + qgZ (no secondary shard's
    memory; the only one under a pipeline, where the trainer refuses hpZ)."""
    lay = plan.layout
    if lay.zero != 3 or lay.qwz or lay.nd <= replicas_per_node(lay, node_size):
        return [], 0.0, True
    light = dataclasses.replace(lay, qwz=True, qgz=True)
    return ([dataclasses.replace(light, hpz=True)] if lay.pp == 1 else []) + [light], \
        dp_exposed_s(plan), True


def accumulate_variants(plan: Plan, node_size: int) -> tuple[list[Layout], float, bool]:
    """The unsharded-accumulation variant of a ZeRO-2/3 layout that accumulates over
    replicas without a pipeline (module docstring), or none."""
    lay = plan.layout
    if (lay.zero < 2 or lay.pp > 1 or lay.microbatches < 2 or lay.nd < 2
            or lay.accumulate == "unsharded"):
        return [], 0.0, True
    return [dataclasses.replace(lay, accumulate="unsharded")], dp_exposed_s(plan), True


def v_variants(plan: Plan, node_size: int) -> tuple[list[Layout], float, bool]:
    """ZB-V and DualPipeV (two chunks per stage in a V) of a ZB-H1 layout: the same stages
    and micro-batches, another bubble and activation peak (plan/schedule_terms.py)."""
    lay = plan.layout
    if lay.pp == 1 or lay.schedule != "zb-h1":
        return [], 0.0, False
    return [dataclasses.replace(lay, schedule=s, v=2) for s in ("zbv", "dualpipev")], \
        plan.time.bubble_s, False


def with_variants(plans: list[Plan], cfg: ModelConfig, hw: Hardware, make: Variants, *,
                  top: int, data: DataConfig | None) -> tuple[list[Plan], int, int]:
    """`plans` plus the variants (`make`) the trainer runs and that fit of each plan that
    could then enter the `top`, ranked. Returns (ranked plans, variants the trainer ran,
    variants it refused)."""
    plans, added, ran, refused = sorted(plans, key=rank), [], 0, 0
    best = [p.time.step_s for p in plans[:top]]  # the top's step times, ascending
    for plan in plans:
        cutoff = best[-1] if len(best) >= top else math.inf
        node = hw.node_size(plan.layout.gpus)
        variants, saving, first_only = make(plan, node)  # the saving priced only if any
        if not variants or plan.time.step_s - saving >= cutoff:
            continue
        for variant in variants:
            if trainer_refusal(variant, cfg, seq_len=plan.seq_len, data=data) is not None:
                refused += 1
                continue
            ran += 1
            memory = memory_per_gpu(cfg, variant, seq_len=plan.seq_len, node_size=node)
            if fits(memory, hw):
                added.append(evaluate(cfg, variant, hw, global_batch=plan.global_batch,
                                      seq_len=plan.seq_len, name=plan.name, memory=memory))
                bisect.insort(best, added[-1].time.step_s)
                del best[top:]
                if first_only:
                    break
    return sorted(plans + added, key=rank), ran, refused


def rank(plan: Plan) -> tuple[float, float]:
    return plan.time.step_s, plan.memory.total
