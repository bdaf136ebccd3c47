"""Layout search: enumerate layouts, keep those the trainer runs, drop those that do not
fit, rank the rest.

Enumerated: tp among the divisors of the node size; pp among the divisors of the layer
count; cp > 1 only for sequences of 8K tokens or more, ring and Ulysses; for a
mixture-of-experts model ep among the divisors of dp x cp that divide the experts;
micro-batches of 1-16 sequences dividing the per-replica batch; ZeRO 0-3 when there is
data parallelism (one stage otherwise: they coincide); recompute none / selective / full;
sp with tp; GPipe, ZB-H1, interleaved (v dividing the layers per stage, m a multiple of
p); ZB-V and DualPipeV as variants of the fitting ZB-H1 layouts that could then rank in
the top (variants.py). Every candidate
then goes through the trainer's own config validation
(`layout.trainer_refusal`: `Config.validate` of the config `layout_overrides` describes),
so a layout the trainer refuses (a tp that does not split the kv heads, an sp or cp that
does not split the sequence, Ulysses heads cp does not divide, ...) is never proposed, and
no rule is restated here: when the trainer learns a composition, the search proposes it.
ZeRO++ (qwZ, hpZ, qgZ), asked for (`zeropp`: its int8 weights and gradients change the
numbers, at an accuracy cost the planner does not price), is tried on the fitting ZeRO-3
layouts whose replica group spans nodes and that could then rank in the top
(variants.py), as is unsharded accumulation (parallel.zero_accumulate) on every fitting
ZeRO-2/3 layout with micro-batches to accumulate that could then rank. The
run's data section takes part (`data`: what it asks of a layout, through the trainer's
validation). Replica groups
(`replica`: parallel.replicas and the sync fields, fixed by the caller) go into every
layout, and one whose dp (or a group's dp x cp for ep) they do not split is refused. Offload
(cpu, nvme) is tried only when nothing fits without it. Ranked by predicted step time,
then memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardtrain.config import DataConfig, ModelConfig
from shardtrain.cost.counts import param_counts
from shardtrain.plan.evaluate import Plan, evaluate, fits
from shardtrain.cost.hardware import Hardware
from shardtrain.plan.layout import Layout, PlanError, check, planned_attention, trainer_refusal
from shardtrain.plan.layout_checks import check_replica_groups
from shardtrain.plan.memory import MemoryBreakdown, memory_per_gpu
from shardtrain.plan.variants import (accumulate_variants, v_variants, with_variants,
                                     zeropp_variants)

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Rejected:
    layout: Layout
    memory: MemoryBreakdown
    reason: str


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    ranked: tuple[Plan, ...]  # the fastest `top`; empty when nothing fits
    rejected: tuple[Rejected, ...]  # the `top` that came closest to fitting
    considered: int  # enumerated layouts the trainer accepts
    rejected_total: int
    refused: int = 0  # enumerated layouts the trainer's config validation refuses
    closest: Plan | None = None  # nothing fits: the closest layout, evaluated in full
    reason: str = ""  # nothing fits: why, and the knob that helps most


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: ModelConfig, *, gpus: int, node_size: int, global_batch: int,
               seq_len: int, precision: str, offload: str = "none",
               data: DataConfig | None = None) -> Iterator[Layout]:
    """The enumerated layouts the trainer's config validation accepts."""
    for layout in enumerate_layouts(cfg, gpus=gpus, node_size=node_size,
                                    global_batch=global_batch, seq_len=seq_len,
                                    precision=precision, offload=offload):
        if trainer_refusal(layout, cfg, seq_len=seq_len, data=data) is None:
            yield layout


def enumerate_layouts(cfg: ModelConfig, *, gpus: int, node_size: int, global_batch: int,
                      seq_len: int, precision: str, offload: str = "none") -> Iterator[Layout]:
    """Every layout of the module docstring's grid that fills the GPUs and splits the
    batch, before config validation."""
    for tp in _divisors(min(node_size, gpus)):
        if gpus % tp:
            continue
        for pp in _divisors(cfg.n_layers):
            # cp splits each sequence into 2 cp chunks (the zigzag split, parallel.cp_split)
            cps = [c for c in (1, 2, 4, 8) if seq_len >= 8192 and seq_len % (2 * c) == 0] or [1]
            for cp in cps:
                if gpus % (tp * pp * cp) or global_batch % (gpus // (tp * pp * cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                eps = [e for e in _divisors(dp * cp) if cfg.n_experts % e == 0] \
                    if cfg.n_experts else [1]
                for cp_mode in ("ring", "ulysses") if cp > 1 else ("ring",):
                    for ep in eps:
                        yield from _inner(cfg, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                                          cp_mode=cp_mode, global_batch=global_batch,
                                          seq_len=seq_len, precision=precision,
                                          offload=offload)


def _inner(cfg: ModelConfig, *, dp: int, tp: int, pp: int, cp: int, ep: int, cp_mode: str,
           global_batch: int, seq_len: int, precision: str, offload: str) -> Iterator[Layout]:
    sps = (False, True) if tp > 1 else (False,)
    zeros = {"none": (0, 1, 2, 3), "cpu": (1, 2, 3), "nvme": (3,)}[offload]
    zeros = tuple(z for z in zeros if dp * cp > 1 or z == zeros[0])  # all alike on one replica
    per_replica = global_batch // dp
    for b in (b for b in (1, 2, 4, 8, 16) if per_replica % b == 0):
        m = per_replica // b
        # A pipeline runs ZB-H1 rather than 1F1B: 1F1B's memory, a smaller bubble
        # (plan/schedule_terms.py), so 1F1B would never rank above it.
        schedules = [("1f1b" if pp == 1 else "zb-h1", 1)]
        if pp > 1:
            schedules.append(("gpipe", 1))
            if m % pp == 0:
                schedules += [("interleaved", v) for v in _divisors(cfg.n_layers // pp)
                              if 2 <= v <= 8]
            # ZB-V and DualPipeV: variants of the fitting ZB-H1 layouts (variants.py)
        for zero in zeros:
            for recompute in ("none", "selective", "full"):
                for sp in sps:
                    for schedule, v in schedules:
                        for partition in _partitions(cfg, zero, dp, tp * pp * cp, offload):
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode, ep=ep,
                                         zero=zero, offload=offload, precision=precision,
                                         recompute=recompute, sp=sp, micro_batch=b,
                                         microbatches=m, schedule=schedule, v=v,
                                         partition=partition,
                                         attention=planned_attention(cfg, precision))


def _partitions(cfg: ModelConfig, zero: int, dp: int, model_ranks: int,
                offload: str) -> tuple[str, ...]:
    """ZeRO-3's partitions worth pricing: flat, and layer (whole units per rank) where the
    trainer runs it (plan/layout_checks.py `check_layer_partition`)."""
    layer = zero == 3 and dp > 1 and model_ranks == 1 and offload == "none" \
        and not cfg.n_experts
    return ("flat", "layer") if layer else ("flat",)


def search(cfg: ModelConfig, hw: Hardware, *, gpus: int, global_batch: int, seq_len: int,
           name: str = "", top: int = 5, precision: str | None = None,
           data: DataConfig | None = None, zeropp: bool = False,
           replica: dict[str, Any] | None = None) -> SearchResult:
    """The `top` fastest layouts the trainer runs that fit (`zeropp`: ZeRO++'s quantized
    variants too; `replica`: the replica-group fields every layout takes, REPLICA_FIELDS,
    a layout whose dp they do not split refused). When none fits, `ranked` is empty and `reason` says why (the missing
    memory and the knob that helps most), with the closest layout evaluated in `closest`
    (none when no layout splits batch and layers)."""
    precision = precision or hw.default_precision
    node = hw.node_size(gpus)
    fitting: list[tuple[Layout, MemoryBreakdown]] = []
    rejected: list[Rejected] = []
    considered = refused = 0
    for offload in ("none", "cpu", "nvme"):
        for layout in enumerate_layouts(cfg, gpus=gpus, node_size=node,
                                        global_batch=global_batch, seq_len=seq_len,
                                        precision=precision, offload=offload):
            layout = dataclasses.replace(layout, **(replica or {}))
            if _refused(layout, cfg, seq_len=seq_len, data=data):
                refused += 1
                continue
            considered += 1
            memory = memory_per_gpu(cfg, layout, seq_len=seq_len, node_size=node)
            if fits(memory, hw):
                fitting.append((layout, memory))
            else:
                rejected.append(Rejected(layout=layout, memory=memory,
                                         reason=shortfall(memory, hw)))
        if fitting:
            break
    rejected.sort(key=lambda r: r.memory.total)
    counts = dict(considered=considered, rejected_total=len(rejected), refused=refused,
                  rejected=tuple(rejected[:top]))
    if not fitting:
        if not rejected:
            return SearchResult(ranked=(), **counts, reason=(
                f"no layout of {gpus} GPUs (node size {node}) that the trainer runs can split "
                f"the global batch {global_batch} and {cfg.n_layers} layers ({refused} refused "
                "by config validation); pick a --global-batch divisible by more "
                "data-parallel degrees"))
        near = rejected[0]
        closest = evaluate(cfg, near.layout, hw, global_batch=global_batch, seq_len=seq_len,
                           name=name, memory=near.memory)
        return SearchResult(ranked=(), **counts, closest=closest, reason=(
            f"{name or 'the model'} fits nowhere on {gpus} x {hw.name}: the closest layout "
            f"({near.layout.describe()}) {near.reason}. "
            + advice(cfg, near.layout, hw, seq_len=seq_len, gpus=gpus,
                     global_batch=global_batch, memory=near.memory, data=data)))
    plans = [evaluate(cfg, lay, hw, global_batch=global_batch, seq_len=seq_len, name=name,
                      memory=mem) for lay, mem in fitting]
    for make in (v_variants, accumulate_variants, *([zeropp_variants] if zeropp else [])):
        plans, ran, refused_variants = with_variants(plans, cfg, hw, make, top=top, data=data)
        counts["considered"] += ran
        counts["refused"] += refused_variants
    return SearchResult(ranked=tuple(plans[:top]), **counts)


def _refused(layout: Layout, cfg: ModelConfig, *, seq_len: int, data: DataConfig | None) -> bool:
    """The replica groups do not split the layout (layout_checks.py), or the trainer refuses it."""
    try:
        check_replica_groups(layout)
    except PlanError:
        return True
    return trainer_refusal(layout, cfg, seq_len=seq_len, data=data) is not None


def shortfall(memory: MemoryBreakdown, hw: Hardware) -> str:
    if memory.total <= hw.usable_bytes:  # the device has room: the host has not (`fits`)
        room = hw.usable_fraction * hw.host_memory_bytes
        return (f"offloads {memory.host / GB:.2f} GB per GPU to host memory, "
                f"{(memory.host - room) / GB:.2f} GB more than the {room / GB:.2f} GB usable "
                "of the node's host memory per GPU")
    items = {k: v for k, v in memory.to_dict().items()
             if k not in ("total", "activations_per_layer", "offloaded", "host")}
    largest = max(items, key=items.__getitem__)
    return (f"needs {memory.total / GB:.2f} GB per GPU, {(memory.total - hw.usable_bytes) / GB:.2f}"
            f" GB more than the {hw.usable_bytes / GB:.2f} GB usable (largest: {largest} "
            f"{items[largest] / GB:.2f} GB)")


def advice(cfg: ModelConfig, layout: Layout, hw: Hardware, *, seq_len: int, gpus: int,
           global_batch: int, memory: MemoryBreakdown, data: DataConfig | None = None) -> str:
    """Which single change lowers this layout's memory most (and what each would need), or,
    when none makes it fit, roughly how many GPUs or how short a sequence would."""
    lay = layout
    knobs = {"zero=1": dict(zero=1), "zero=2": dict(zero=2), "zero=3": dict(zero=3),
             "recompute=selective": dict(recompute="selective"),
             "recompute=full": dict(recompute="full"), "sp=true": dict(sp=True),
             "micro_batch=1": dict(micro_batch=1, microbatches=lay.microbatches * lay.micro_batch),
             "offload=cpu": dict(offload="cpu", zero=max(1, lay.zero)),
             "offload=nvme": dict(offload="nvme", zero=3)}
    after: dict[str, float] = {}
    for knob, change in knobs.items():
        variant = dataclasses.replace(lay, **change)
        try:
            check(variant, cfg, gpus=gpus, node_size=hw.node_size(gpus),
                  global_batch=global_batch, seq_len=seq_len)
        except PlanError:
            continue
        if trainer_refusal(variant, cfg, seq_len=seq_len, data=data) is not None:
            continue  # advise only what the trainer runs
        total = memory_per_gpu(cfg, variant, seq_len=seq_len,
                               node_size=hw.node_size(gpus)).total
        if variant != lay and total < memory.total:
            after[knob] = total
    ranked = sorted(after, key=after.__getitem__)
    if ranked and after[ranked[0]] <= hw.usable_bytes:
        fitting = [k for k in ranked if after[k] <= hw.usable_bytes]
        return (f"The knob that helps most: {ranked[0]} (then {after[ranked[0]] / GB:.1f} GB "
                "per GPU); each of these fits alone: "
                + ", ".join(f"{k} ({after[k] / GB:.1f} GB)" for k in fitting) + ".")
    states = memory.params + memory.grads + memory.optimizer + memory.master
    room = hw.usable_bytes - memory.activations - memory.buffers
    if states >= memory.activations and room > 0:
        node = hw.node_size(gpus)
        need = math.ceil(16 * param_counts(cfg).total / room / node) * node
        return (f"Model states take {states / GB:.1f} GB per GPU: the knob that helps most is "
                f"more GPUs (about {max(need, gpus + 1):,} with zero=3, 16 bytes per parameter) "
                "or a --gpu with more memory.")
    return (f"Activations take {memory.activations / GB:.1f} GB per GPU: the knob that helps "
            "most is a shorter --seq (or more pipeline stages and GPUs).")
