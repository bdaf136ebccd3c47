"""ZeRO++ (Wang et al. 2023) in the planner: the bytes each option puts on the wire, unit by
unit and bucket by bucket as parallel/zero/zeropp.py moves them, so the ledger of a run
equals `zeropp_ops` to the byte (tests/test_plan_zeropp.py).

Wire format (comm/compress.py pack_int8): int8 values in blocks of comm.quant_block (256 by
default), one fp32 absmax scale per block, so n values travel as ceil(n / block) x
(block + 4) bytes: about 1.02 bytes per value against 2 (bf16) or 4 (fp32).
- qwZ (`qwz`): every parameter all-gather (ZeRO-3's forward and backward ones, stages
  1-2's after the step) sends each rank's shard packed. The units are laid out with every
  parameter at a multiple of the block and each shard a whole number of blocks
  (zero/units.py `align`), so a unit of P elements pads to a multiple of p x block.
- hpZ (`hpz`, ZeRO-3): the backward gather of every unit (but the embedding's lookup
  tables, gathered for forward only: cost/units.py `backward_reads_params`) runs inside
  the node, over the s replicas there, from the secondary shard (P / s, in the gather
  dtype) that the forward gather left: (s - 1) / s of the unit's gathered bytes, none of
  them across nodes.
- qgZ (`qgz`): each gradient bucket's reduce-scatter (N values per rank) becomes an int8
  all-to-all, p rows of ceil(N / block) (block + 4) bytes, (p - 1) of them sent. When the
  group spans nodes with 1 < s < p replicas on each, two hops: inside the node s rows of
  p / s packed chunks, then across the p / s nodes one packed chunk per node. The same
  bytes in all, s times fewer across nodes (seed 004's "hierarchical" qgZ).
Time: the collective's (cost/collectives.py) plus the int8 coding, which the runtime runs in
the collective's own job: memory-bound, priced at hw.memory_bw for the bytes it reads and
writes (comments in `zeropp_group_ops`). Units come from the model exactly
(plan/rank_states.py, dense models); a mixture-of-experts
model's dense and expert groups are taken as `layers` equal units (no alignment), close
but not to the byte. Each op's time uses its mean message (the units differ in size).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace

from shardtrain.config import CommConfig, ModelConfig
from shardtrain.cost.hardware import Hardware
from shardtrain.cost.units import (ROUNDED, backward_reads_params, coalesce, launch_order,
                                   unit_key)
from shardtrain.plan.layout import Layout, PlanError
from shardtrain.plan.memory import (STATE_BYTES, ModelStates, replicas_per_node,
                                     wire_grad_bytes, zero3_gather_bytes)
from shardtrain.plan.ops import CommOp, Placement, a2a, collective, placement
from shardtrain.plan.partition import rank_params
from shardtrain.plan.rank_states import rank0_tensors, zero_units

QUANT_BLOCK = CommConfig().quant_block  # values per int8 scale (comm.quant_block)
SCALE_BYTES = 4  # one fp32 absmax scale per block


@dataclass(frozen=True)
class Unit:
    elements: float  # the flat unit, padded: a multiple of the group size (x block, qwZ)
    gather: float  # bytes per element as gathered without qwZ (its gather dtype)
    backward: bool = True  # gathered again for backward (not the embedding's lookup tables:
    # cost/units.py `backward_reads_params`)


def packed_bytes(n: float, block: int = QUANT_BLOCK) -> float:
    """Bytes of n values as int8 blocks plus their fp32 scales (pack_int8)."""
    return math.ceil(n / block) * (block + SCALE_BYTES)


def any_zeropp(layout: Layout) -> bool:
    return layout.qwz or layout.hpz or layout.qgz


def dense_units(cfg: ModelConfig, layout: Layout, *, block: int = QUANT_BLOCK) -> list[Unit]:
    """The replica group's units exactly as zero/model.py builds them, in launch order (the
    order backward reduces them: cost/units.py). Cached: the search asks for the same
    units for many layouts."""
    lay = layout
    rounded = lay.zero == 3 and lay.precision == "amp"
    key = (repr(cfg), lay.tp, lay.pp, lay.v, lay.nd, rounded, lay.precision,
           block if lay.qwz else 1, lay.unit_blocks)
    if key not in _UNITS:
        _UNITS[key] = _dense_units(cfg, lay, rounded=rounded, align=block if lay.qwz else 1)
    return _UNITS[key]


_UNITS: dict[tuple, list[Unit]] = {}


def _dense_units(cfg: ModelConfig, lay: Layout, *, rounded: bool, align: int) -> list[Unit]:
    tensors = rank0_tensors(cfg, lay)
    sizes = zero_units(tensors, nd=lay.nd, tied=cfg.tie_embeddings, n_layers=cfg.n_layers,
                       rounded=rounded, align=align, blocks=lay.unit_blocks)
    keys = list(sizes)  # forward order
    names: dict[tuple[int, int, int], list[str]] = {k: [] for k in keys}
    for name, _ in tensors:
        names[unit_key(name, tied=cfg.tie_embeddings, n_layers=cfg.n_layers,
                       rounded=rounded, blocks=lay.unit_blocks)].append(name)
    width = STATE_BYTES[lay.precision][0]
    return [Unit(sizes[keys[i]], 2 if rounded and keys[i][2] == ROUNDED else width,
                 backward_reads_params(keys[i]))
            for i in launch_order([names[k] for k in keys], tied=cfg.tie_embeddings)]


def even_units(params: float, kept: float, layers: int, layout: Layout) -> list[Unit]:
    """`layers` equal units of `params` in all (the planner's mixture-of-experts estimate)."""
    if params <= 0:
        return []
    lay = layout
    gather = zero3_gather_bytes(params, kept, lay.precision) / params if lay.zero == 3 \
        else STATE_BYTES[lay.precision][0]
    return [Unit(params / layers, gather)] * layers


def zeropp_group_ops(units: list[Unit], layout: Layout, *, size: int, local: int,
                     where: Placement, intra: Placement, inter: Placement, group: str = "dp",
                     bucket_bytes: float, block: int = QUANT_BLOCK,
                     memory_bw: float = math.inf) -> list[CommOp]:
    """One group's ZeRO traffic in a step with the layout's ZeRO++ options (module
    docstring): `size` ranks, `local` of them per node; `memory_bw` prices the int8
    coding (module docstring)."""
    lay, m = layout, layout.microbatches
    if size <= 1 or not units:
        return []
    pipelined = lay.pp > 1 or lay.accumulate == "unsharded"  # once per step (traffic.py)
    grad_bytes = wire_grad_bytes(lay.precision, lay.reduce_dtype)
    gathers = 1 if lay.zero < 3 or pipelined else m  # per unit and kind (forward, backward)

    def shard_gather(group: list[Unit]) -> float:
        return sum(size * packed_bytes(u.elements / size, block) if lay.qwz
                   else u.elements * u.gather for u in group)

    def dequantized(group: list[Unit]) -> float:
        # qwZ's coding: the fp32 shard read and its int8 written (5 bytes a value), every
        # gathered int8 read and written in the gather dtype (1 + gather)
        return gathers * sum(u.elements * (1 + u.gather) + 5 * u.elements / size
                             for u in group) if lay.qwz else 0.0

    ops: list[CommOp] = []

    def add(op: str, n: int, total: float, calls: int, at: Placement, overlap: str,
            what: str = "", coded: float = 0.0) -> None:
        """`coded`: bytes the int8 coding reads and writes in memory over the step."""
        if n > 1 and calls:
            made = collective(group, op, n, total / calls, calls, at, overlap) \
                if op != "all_to_all" else a2a(n, total / calls, calls, at, group, what)
            ops.append(dataclasses.replace(made, overlap=overlap, what=what,
                                           time_s=made.time_s + coded / memory_bw))

    count = len(units)
    overlap = "compute" if lay.zero == 3 and not pipelined else "none"
    add("all_gather", size, gathers * shard_gather(units), gathers * count, where, overlap,
        "int8" if lay.qwz else "", dequantized(units))
    again = [u for u in units if u.backward]
    if lay.zero == 3 and not pipelined and again:  # backward's gathers: hpZ inside the node
        if lay.hpz:
            add("all_gather", min(local, size), gathers * sum(u.elements * u.gather
                                                               for u in again),
                gathers * len(again), intra, "compute", "hpz")
        else:
            add("all_gather", size, gathers * shard_gather(again), gathers * len(again),
                where, "compute", "int8" if lay.qwz else "", dequantized(again))
    buckets = coalesce([u.elements * grad_bytes for u in units], bucket_bytes)
    syncs = 1 if lay.zero == 1 or pipelined else m
    rows = [sum(units[i].elements for i in b) / size for b in buckets]  # N per rank
    overlap = "step" if syncs == 1 else "backward"
    calls = syncs * len(buckets)
    # qgZ's coding per value sent: read in the reduce dtype (hop 2's partials in fp32) and
    # written in int8 (1); received: int8 read (1), fp32 written (4), read by the sum (4)
    coded = syncs * sum(rows) * size
    if not lay.qgz:
        add("reduce_scatter", size, syncs * sum(n * size * grad_bytes for n in rows), calls,
            where, overlap)
    elif 1 < local < size:  # two hops
        nodes = size // local
        add("all_to_all", local, syncs * sum(local * nodes * packed_bytes(n, block)
                                             for n in rows), calls, intra, overlap, "int8 node",
            coded * (grad_bytes + 10))
        add("all_to_all", nodes, syncs * sum(nodes * packed_bytes(n, block) for n in rows),
            calls, inter, overlap, "int8 inter", coded / local * 14)
    else:
        add("all_to_all", size, syncs * sum(size * packed_bytes(n, block) for n in rows),
            calls, where, overlap, "int8", coded * (grad_bytes + 10))
    return ops


def zeropp_ops(cfg: ModelConfig, layout: Layout, hw: Hardware, *, bucket_bytes: float,
               block: int = QUANT_BLOCK) -> list[CommOp]:
    """The dp (and edp) traffic of one step under ZeRO++ (replaces traffic.py's
    data_parallel_ops for those groups)."""
    lay = layout
    if not lay.zero:
        raise PlanError("layout qwz, hpz and qgz act on ZeRO's collectives: set zero >= 1")
    node = hw.node_size(lay.gpus)
    ranks = rank_params(cfg, lay)
    intra, inter = Placement(link=hw.intra_link()), Placement(link=hw.inter_link())
    local = replicas_per_node(lay, node)
    common = dict(intra=intra, inter=inter, bucket_bytes=bucket_bytes, block=block,
                  memory_bw=hw.memory_bw)
    if not cfg.n_experts:
        return zeropp_group_ops(dense_units(cfg, lay, block=block), lay, size=lay.nd,
                                local=local, where=placement(hw, node, lay.tp, lay.nd),
                                **common)
    edp = lay.nd // lay.ep
    return (zeropp_group_ops(even_units(ranks.dense, ranks.kept, ranks.layers, lay), lay,
                             size=lay.nd, local=local,
                             where=placement(hw, node, lay.tp, lay.nd), **common)
            + zeropp_group_ops(even_units(ranks.expert, ranks.kept_expert, ranks.layers, lay),
                               lay, size=edp, local=max(1, local // lay.ep), group="edp",
                               where=placement(hw, node, lay.tp * lay.ep, edp), **common))


def zeropp_states(states: ModelStates, layout: Layout, ranks, *, node_size: int) -> ModelStates:
    """ZeRO++'s model-state terms (Wang et al. 2023; parallel/zero/zeropp.py): hpZ keeps a
    secondary shard, 1/s of each unit gathered again for backward (s = the replicas on a
    node; experts: their edp group's; not the lookup tables, kept in fp32), in the gather
    dtype; qwZ at stages 1-2 gives the parameters that are their
    own fp32 master (fp32, amp) a master shard of their own (the dequantized gather lands in
    the parameter shard)."""
    lay, out = layout, states
    if lay.hpz:
        if node_size < 1:
            raise PlanError("layout hpz=true: hpZ's secondary shard is 1/s of the parameters, "
                            "s the dp ranks per node; give the planner the node size")
        groups = ((ranks.dense - ranks.lookup, ranks.kept - ranks.lookup, lay.nd),
                  (ranks.expert, ranks.kept_expert, lay.nd // lay.ep))
        local = replicas_per_node(lay, node_size)
        out = replace(out, params=out.params + sum(
            zero3_gather_bytes(n, kept, lay.precision) / min(size, local)
            for n, kept, size in groups if n))
    if lay.qwz and lay.zero < 3 and not out.master and lay.offload == "none":
        out = replace(out, master=4 * (ranks.dense / lay.nd
                                       + ranks.expert / (lay.nd // lay.ep)))
    return out
