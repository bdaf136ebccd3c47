"""Communication per optimizer step: each group's ops, bytes sent per rank and time.

Groups and what they move (bytes sent by one rank per step; X = s b h activation bytes of
one micro-batch, s = seq / cp; P, G = this rank's parameter and gradient bytes):
- dp (Nd = dp x cp / replicas ranks: one replica group's, plan/replica_traffic.py for what
  crosses the groups; ZeRO, Rajbhandari et al. 2020): DP all-reduces G once per step,
  2 (n-1)/n G; ZeRO-1 reduce-scatters G once and all-gathers the updated P, the same
  bytes; ZeRO-2 reduce-scatters every micro-batch (it keeps no full gradient to
  accumulate into); ZeRO-3 all-gathers P twice (forward, backward) and reduce-scatters G
  every micro-batch: 1.5x DP's bytes when m = 1, less the embedding's lookup tables,
  gathered for forward only (their backward reads only the token ids: cost/units.py
  `backward_reads_params`; under amp it gathers the weights autocast rounds in 16 bits, the
  rest in fp32: cost/units.py). With pp > 1 (zero/model.py) ZeRO-2
  and 3 reduce-scatter G once per step, after the last micro-batch, and ZeRO-3 all-gathers P once
  per step, before the first: ZeRO-2 moves ZeRO-1's bytes, ZeRO-3 DP's; so does
  parallel.zero_accumulate = unsharded at pp = 1 (plan/accumulate.py). DP's gradients
  travel in buckets of comm.bucket_mb (25 MB); ZeRO's in buckets of whole consecutive
  units of at most that size (a larger unit alone: cost/units.py `coalesce`), its
  parameters one unit (layer) at a time. `edp` is the same for expert parameters
  (dp x cp / ep). ZeRO++ (qwZ, hpZ, qgZ) replaces these with plan/zeropp.py's ops.
  Under train.fp8=tensorwise (cost/fp8.py `fp8_gathers`) ZeRO-3 gathers the blocks' linear
  weights in e4m3, 1 byte each, every block unit's gather after an all-reduce max of one
  fp32 amax per converted weight (`fp8_gather_terms`; parallel/zero/fp8_gather.py).
- tp (Megatron-LM; Korthikanti et al. 2022): per layer and micro-batch, all-reduces of X,
  2 forward + 2 backward (+2 with full recomputation); with sp, all-gathers and
  reduce-scatters of X instead, and the backward's re-gather of each region's input;
  plus the head, the vocabulary-parallel embedding and loss (plan/tensor_traffic.py).
- pp: point-to-point, the busiest (middle) stage sends one activation forward and one
  gradient backward per micro-batch and virtual chunk (X / t with sp), in the compute dtype.
- cp (`context_parallel_ops`, what parallel/context/ sends; per layer, micro-batch and
  rank; N = cp, s = S/N local tokens, H, G the query and kv heads of one tp rank, D the
  head dim, v the compute dtype's bytes): ring attention (Liu et al. 2023) sends the
  packed K,V block [2, b, G, s, D] N-1 times forward, N-1 times again in backward, and the
  packed fp32 dK,dV partials N times; full recomputation reruns the forward's N-1. They
  overlap the attention compute. Ulysses (Jacobs et al. 2023) all-to-alls the packed
  q,k,v [b, s, H+2G', D] and the output [b, s, H, D] forward, dout and dq,dk,dv backward
  (G' = G when N divides it, else H: kv heads repeated), each sending (N-1)/N of its
  input; exposed. Full recomputation reruns the forward's two; selective changes neither
  mode (a context-parallel core declares `recomputes_in_backward` and is not wrapped).
  Latent attention (model.attention = mla) moves the decompressed K and V, not the latent:
  G = H heads, D = qk_nope + qk_rope head dims, V zero-padded to D (model/mla.py).
- ep (`expert_parallel_ops`, what parallel/expert/layers.py sends; native pairwise
  all-to-alls, the ledger's (n-1)/n of the input): per MoE layer on this stage and
  micro-batch, the kept-slot counts [E] int64, the slot rows [K, C] to the experts' ranks
  and the expert outputs back; backward the two swapped. Each tp rank routes its own
  T = b s/cp tokens (/ t with sp) into K = T k slots, under uniform routing (dropless: the
  slots depend on the data, K is their mean) or at most E ceil(f T k / E) under a capacity
  factor f. Rows travel in their dtype: the normed input (the residual stream's, fp32
  under amp) to the experts, the experts' output back (16-bit under amp for SwiGLU; gpt2's
  fp32 bias add makes it fp32). Full recomputation reruns the forward's three; selective
  leaves the MoE block alone (it checkpoints the attention core). Under sp and cp (any
  ep) the balance loss's [E] int64 routed counts are all-reduced over tp and over cp per
  MoE forward (`moe_counts_ops`).
Times come from `shardtrain.cost.collectives` with the fastest algorithm for the group's
placement: inside a node the NVLink/PCIe link, across nodes one GPU's share of the node's
network (flat), or two-tier (hierarchical, torus2d) when a group spans part of a node.
The tied embedding's gradients between the first and last stage are ignored (small).
"""

from __future__ import annotations

import math

from shardtrain.config import ModelConfig
from shardtrain.cost.hardware import Hardware
from shardtrain.cost.counts import kept_params
from shardtrain.cost.fp8 import converted_per_block, fp8_gathers
from shardtrain.cost.units import coalesce
from shardtrain.plan.activations import kv_heads_per_rank, ulysses_kv_heads
from shardtrain.plan.buffers import block_units
from shardtrain.plan.layer_partition import layer_ops
from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import (BUCKET_BYTES, STATE_BYTES, wire_grad_bytes,
                                    zero3_gather_bytes)
from shardtrain.plan.ops import (FREE, CommOp, Placement, a2a, bytes_per_step,  # noqa: F401
                                 collective, p2p, placement)
from shardtrain.plan.partition import RankParams, rank_params
from shardtrain.plan.replica_traffic import cross_replica_ops
from shardtrain.plan.tensor_traffic import tensor_parallel_ops
from shardtrain.plan.ps import ps_ops
from shardtrain.plan.zeropp import any_zeropp, zeropp_ops




def data_parallel_ops(*, params: float, size: int, zero: int, microbatches: int = 1,
                      precision: str = "bf16", where: Placement = FREE, group: str = "dp",
                      layers: int = 1, bucket_bytes: float = BUCKET_BYTES,
                      reduce_dtype: str = "", pipelined: bool = False,
                      kept: float = 0.0, unsharded: bool = False,
                      lookup: float = 0.0, fp8: float = 0.0,
                      fp8_scales: float = 0.0) -> list[CommOp]:
    """Gradient synchronisation and ZeRO parameter traffic of `params` parameters held by
    each of `size` ranks (see the module docstring); `layers`: ZeRO's units (ZeRO-3 gathers
    one at a time, ZeRO-1/2 after the step; their gradients go in `bucket_bytes` buckets);
    `pipelined` (pp > 1) or `unsharded` (parallel.zero_accumulate): ZeRO-2/3 reduce (and
    ZeRO-3 gathers) once per step.
    Parameters travel in the precision's parameter bytes (STATE_BYTES), except ZeRO-3's
    gathers under amp (`zero3_gather_bytes`: `kept` of them in fp32, the rest 16-bit);
    gradients in `reduce_dtype`'s (train.grad_reduce_dtype; "": the precision's).
    `lookup`: of `params`, lookup tables (kept in fp32 under amp) that ZeRO-3 gathers for
    forward only (module docstring). `fp8`: of `params`, weights ZeRO-3 gathers in e4m3
    (1 byte, not 2), each of the `layers` units' gathers after an all-reduce max of its
    share of `fp8_scales` fp32 amaxes (`fp8_gather_terms`)."""
    if size <= 1 or params <= 0:
        return []
    p_bytes = STATE_BYTES[precision][0] * params
    g_bytes = wire_grad_bytes(precision, reduce_dtype) * params
    if zero == 3:
        p_bytes = zero3_gather_bytes(params, kept, precision) - fp8  # fp8: 2 bytes -> 1
    m, pipelined = microbatches, pipelined or unsharded
    if zero == 0:
        buckets = max(1, math.ceil(g_bytes / bucket_bytes))
        return [collective(group, "all_reduce", size, g_bytes / buckets, buckets, where, "step")]
    # ZeRO reduces its units' gradients in buckets of consecutive units (cost/units.py
    # `coalesce`; a unit larger than the bucket alone) and gathers parameters per unit
    buckets = len(coalesce([g_bytes / layers] * layers, bucket_bytes))
    syncs = 1 if zero == 1 or pipelined else m
    reduce = collective(group, "reduce_scatter", size, g_bytes / buckets, buckets * syncs,
                        where, "step" if syncs == 1 else "backward")
    gathers = layers if pipelined else 2 * m * layers  # ZeRO-3's block unit gathers
    amax = [collective(group, "all_reduce", size, 4 * fp8_scales / layers, gathers, where,
                       "none" if pipelined else "compute")] if zero == 3 and fp8_scales else []
    if zero == 3 and pipelined:  # gathered before the stage's first forward, kept all step
        return [collective(group, "all_gather", size, p_bytes / layers, layers, where, "none"),
                *amax, reduce]
    if zero in (1, 2):
        return [reduce, collective(group, "all_gather", size, p_bytes / layers, layers, where,
                                   "none")]
    gathered = 2 * p_bytes - STATE_BYTES[precision][0] * lookup  # forward + backward
    return [collective(group, "all_gather", size, gathered / (2 * layers), 2 * m * layers,
                       where, "compute"), *amax, reduce]


def fp8_gather_terms(cfg: ModelConfig, layout: Layout, ranks: RankParams) -> dict[str, float]:
    """data_parallel_ops' `fp8` and `fp8_scales` where ZeRO-3 gathers the blocks' converted
    weights in e4m3 (cost/fp8.py `fp8_gathers`; parallel/zero/fp8_gather.py): every block's
    linear weights (its parameters less those kept in fp32: norms, biases; no tp here, no
    experts under fp8) and one amax per converted weight."""
    lay = layout
    if not fp8_gathers(fp8=lay.fp8, zero=lay.zero, sixteen_bit=lay.precision != "fp32",
                       zeropp=any_zeropp(lay), partition=lay.partition, tp=lay.tp):
        return {}
    return {"fp8": ranks.layers * (ranks.layer - kept_params(cfg)[0]),
            "fp8_scales": ranks.layers * converted_per_block(cfg)}


def step_ops(cfg: ModelConfig, layout: Layout, hw: Hardware, *, seq_len: int,
             bucket_bytes: float = BUCKET_BYTES) -> list[CommOp]:
    """Every op one (busiest) rank takes part in during one optimizer step."""
    lay = layout
    node = hw.node_size(lay.gpus)
    ranks = rank_params(cfg, lay)
    value = 4 if lay.precision == "fp32" else 2
    s, m, b, h = seq_len // lay.cp, lay.microbatches, lay.micro_batch, cfg.dim
    x = s * b * h * value
    ops: list[CommOp] = []
    if lay.ps_servers:  # pushes and pulls instead of the all-reduce (ps.py)
        return ps_ops(cfg, lay, hw.inter_link() if lay.gpus > node else hw.intra_link())
    units = len(block_units(ranks.layers, ranks.layer, lay.unit_blocks))  # ZeRO's block units
    common = dict(zero=lay.zero, microbatches=m, precision=lay.precision, layers=units,
                  bucket_bytes=bucket_bytes, pipelined=lay.pp > 1, reduce_dtype=lay.reduce_dtype,
                  unsharded=lay.accumulate == "unsharded")
    dp_where = placement(hw, node, lay.tp, lay.nd)
    if any_zeropp(lay):  # quantized and node-local collectives (plan/zeropp.py)
        ops += zeropp_ops(cfg, lay, hw, bucket_bytes=bucket_bytes)
    else:
        ops += layer_ops(cfg, lay, dp_where) if lay.partition == "layer" else \
            data_parallel_ops(group="dp", params=ranks.dense, size=lay.nd, where=dp_where,
                              kept=ranks.kept, lookup=ranks.lookup,
                              **fp8_gather_terms(cfg, lay, ranks), **common)
        ops += data_parallel_ops(group="edp", params=ranks.expert, size=lay.nd // lay.ep,
                                 where=placement(hw, node, lay.tp * lay.ep,
                                                 lay.nd // lay.ep),
                                 kept=ranks.kept_expert, **common)
    # across the replica groups, ranks tp x nd apart (plan/replica_traffic.py)
    ops += cross_replica_ops(lay, ranks, where=placement(hw, node, lay.tp * lay.nd, lay.replicas),
                             bucket_bytes=bucket_bytes)
    ops += tensor_parallel_ops(cfg, lay, seq_len=seq_len, where=placement(hw, node, 1, lay.tp))
    if lay.pp > 1:
        where = placement(hw, node, lay.tp * lay.cp * lay.dp, lay.pp)
        # amp (the runtime's policy) sends the fp32 residual stream in the compute dtype
        ops.append(p2p("pp", lay.pp, x / (lay.tp if lay.sp else 1), 2 * m * lay.v,
                        where.link, "none"))
    if lay.cp > 1:
        ops += context_parallel_ops(cfg, lay, seq_len=seq_len,
                                    where=placement(hw, node, lay.tp, lay.cp))
    ops += moe_counts_ops(cfg, lay, tp=placement(hw, node, 1, lay.tp),
                          cp=placement(hw, node, lay.tp, lay.cp))
    if lay.ep > 1:
        ops += expert_parallel_ops(cfg, lay, seq_len=seq_len,
                                   where=placement(hw, node, lay.tp, lay.ep))
    return ops


def routed_tokens(layout: Layout, *, seq_len: int) -> int:
    """Tokens one rank routes per MoE layer and micro-batch (its cp and sp share)."""
    lay = layout
    return lay.micro_batch * (seq_len // lay.cp) // (lay.tp if lay.sp else 1)


def routed_slots(cfg: ModelConfig, layout: Layout, *, seq_len: int) -> float:
    """Kept slots one rank sends to the experts per MoE layer and micro-batch: T k under
    uniform routing, capped at E ceil(f T k / E) by a capacity factor f (model/moe.py)."""
    slots = routed_tokens(layout, seq_len=seq_len) * cfg.moe_top_k
    if cfg.moe_capacity_factor > 0:
        slots = min(slots, cfg.n_experts * math.ceil(cfg.moe_capacity_factor * slots
                                                     / cfg.n_experts))
    return float(slots)


def expert_parallel_ops(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                        where: Placement = FREE) -> list[CommOp]:
    """The ep group's all-to-alls of one rank in one step (module docstring): counts, the
    slot rows out, the rows back."""
    lay, n = layout, layout.ep
    if n <= 1 or not cfg.n_experts:
        return []
    forwards = 2 if lay.recompute == "full" else 1
    calls = rank_params(cfg, lay).moe_layers * lay.microbatches  # MoE forwards per step
    out_bytes = 2 if lay.precision == "bf16" else 4  # the normed input's dtype
    back_bytes = 4 if lay.precision == "fp32" or (lay.precision == "amp" and
                                                  cfg.style == "gpt2") else 2
    if cfg.sends_per_group(n):  # one row per token and kept group, with its groups' gates
        rows = routed_tokens(lay, seq_len=seq_len) * cfg.moe_max_groups  # capacity or not
        gates = rows * (cfg.n_experts // cfg.moe_groups) * 4
        return [a2a(n, (cfg.moe_groups + n) * 8, calls * forwards, where, "ep", "counts"),
                a2a(n, rows * cfg.dim * out_bytes, calls * (forwards + 1), where, "ep",
                    "dispatch"),
                a2a(n, gates, calls * (forwards + 1), where, "ep", "gates"),
                a2a(n, rows * cfg.dim * back_bytes, calls * (forwards + 1), where, "ep",
                    "combine")]
    rows = routed_slots(cfg, lay, seq_len=seq_len) * cfg.dim
    return [a2a(n, cfg.n_experts * 8, calls * forwards, where, "ep", "counts"),
            a2a(n, rows * out_bytes, calls * (forwards + 1), where, "ep", "dispatch"),
            a2a(n, rows * back_bytes, calls * (forwards + 1), where, "ep", "combine")]


def moe_counts_ops(cfg: ModelConfig, layout: Layout, *, tp: Placement = FREE,
                   cp: Placement = FREE) -> list[CommOp]:
    """The balance loss's [E] int64 routed counts summed over the micro-batch's token group
    (parallel/expert/groups.py, tag moe_counts): an all-reduce over tp under sp and one
    over cp, per MoE training forward (full recomputation's rerun included); any ep."""
    lay = layout
    calls = rank_params(cfg, lay).moe_layers * lay.microbatches * (2 if lay.recompute == "full"
                                                               else 1)
    groups = [("tp", lay.tp, tp)] if lay.sp else []
    return [a2a(size, cfg.n_experts * 8, calls, where, group, "moe_counts", "all_reduce")
            for group, size, where in groups + [("cp", lay.cp, cp)]
            if cfg.n_experts and size > 1]


def context_parallel_ops(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                         where: Placement = FREE) -> list[CommOp]:
    """The cp group's sends of one rank in one step (module docstring)."""
    lay, n = layout, layout.cp
    if n <= 1:
        return []
    value = 4 if lay.precision == "fp32" else 2
    b, s, d = lay.micro_batch, seq_len // n, cfg.qk_head_dim  # mla: k and v padded to it
    heads, kv = cfg.n_heads // lay.tp, kv_heads_per_rank(cfg, lay.tp)
    calls = rank_params(cfg, lay).layers * lay.microbatches  # attention calls per step
    if lay.cp_mode == "ring":
        block = 2 * b * kv * s * d  # packed K,V elements
        forwards = 2 if lay.recompute == "full" else 1
        return [p2p("cp", n, block * value, (n - 1) * (forwards + 1) * calls, where.link,
                     "compute"),
                p2p("cp", n, block * 4, n * calls, where.link, "compute")]  # fp32 dK,dV
    kv = ulysses_kv_heads(cfg, lay.tp, n)
    qkv, out = b * s * (heads + 2 * kv) * d * value, b * s * heads * d * value
    forwards = 2 if lay.recompute == "full" else 1
    return [a2a(n, nbytes, calls * (forwards + 1), where) for nbytes in (qkv, out)]


def cp_bytes_per_step(cfg: ModelConfig, layout: Layout, seq_len: int) -> float:
    """Bytes one rank sends on the cp group in one optimizer step (the ledger's sent_bytes
    summed over the step's cp records)."""
    return sum(op.bytes_sent for op in context_parallel_ops(cfg, layout, seq_len=seq_len))
