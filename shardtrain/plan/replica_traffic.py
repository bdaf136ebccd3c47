"""What crosses the replica groups (parallel.replicas = R, parallel.sync; docs/planner.md):
the bytes one rank sends per optimizer step on its `rep` group, the R ranks with its
coordinates in the other groups.

Priced as the backend's native all-reduce (what the managed process group runs, and the
ledger's convention). Inside a group the layout runs as without groups, over Nd = dp x cp / R (`Layout.nd`:
HSDP, ZeRO sharded inside, so memory and the inner dp terms follow the group's dp;
traffic.py). Across groups, ring all-reduce, 2 (R-1)/R of the payload sent per rank
(FORMULAS.md), where the payload is this rank's share S of the parameters (its ZeRO shard,
P / Nd, under zero >= 1; all of them under zero = 0):
- every_step (tag rep:grad): the gradient shard the optimizer reads, in the gradient reduce
  dtype, once per step: 2 (R-1)/R x S x reduce bytes.
- local_sgd (tag rep:weights): the weights the optimizer updates, every H = sync_every
  steps: fp32 masters where the precision keeps them (bf16), else the parameter dtype;
  per step 2 (R-1)/R x S x weight bytes / H.
- diloco (rep:weights): the pseudo-gradient (weights at the last sync less this group's),
  the same tensors and dtype as local_sgd's weights, every H steps: the same per step.
- sync_fragments F (streaming DiLoCo): a 1/F slice every H/F steps, the same per-step
  average; an op here carries that average (calls = 1, bytes and time per step).
The metrics' cross-replica average (rep:metric, a few scalars) is not counted.
"""

from __future__ import annotations

import math
from dataclasses import replace

from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import BUCKET_BYTES
from shardtrain.plan.state_bytes import STATE_BYTES, wire_grad_bytes
from shardtrain.plan.ops import FREE, CommOp, Placement, a2a
from shardtrain.plan.partition import RankParams

# CommOp.what -> the ledger tag the runtime records the same bytes under
LEDGER_TAGS = {"grad": "rep:grad", "weights": "rep:weights"}


def replica_shard(layout: Layout, ranks: RankParams) -> float:
    """Parameters whose gradients (or weights) this rank's optimizer owns: its ZeRO shard of
    the dense and expert parameters, or all of them without ZeRO."""
    lay = layout
    if lay.zero == 0:
        return ranks.dense + ranks.expert
    return ranks.dense / lay.nd + ranks.expert / (lay.nd // lay.ep)


def weight_bytes(precision: str) -> int:
    """Bytes per parameter of the weights the optimizer updates: the fp32 master where the
    precision keeps one, else the parameter itself (plan/state_bytes.py)."""
    params, _, master, _ = STATE_BYTES[precision]
    return master or params


def cross_replica_ops(layout: Layout, ranks: RankParams, *, where: Placement = FREE,
                      bucket_bytes: float = BUCKET_BYTES) -> list[CommOp]:
    """The rep group's all-reduce of one rank in one step (module docstring)."""
    lay, r = layout, layout.replicas
    if r <= 1:
        return []
    shard = replica_shard(lay, ranks)
    if lay.sync == "every_step":  # in buckets, hiding under the last backward as DP's do
        payload = shard * wire_grad_bytes(lay.precision, lay.reduce_dtype)
        buckets = max(1, math.ceil(payload / bucket_bytes))
        op = a2a(r, payload / buckets, buckets, where, "rep", "grad", "all_reduce")
        return [replace(op, overlap="step")]
    # one fragment of the weights every H / F steps, after the optimizer step: exposed
    fragment = shard * weight_bytes(lay.precision) / lay.sync_fragments
    per_step = lay.sync_fragments / lay.sync_every
    op = a2a(r, fragment, 1, where, "rep", "weights", "all_reduce")
    return [replace(op, bytes_sent=op.bytes_sent * per_step, time_s=op.time_s * per_step)]


def cross_replica_bytes(ops: list[CommOp]) -> dict[str, float]:
    """{ledger tag: bytes one rank sends per step} over the rep group's ops: what the
    runtime's ledger records under rep:grad and rep:weights, averaged over its steps."""
    out = dict.fromkeys(LEDGER_TAGS.values(), 0.0)
    for op in ops:
        if op.group == "rep":
            out[LEDGER_TAGS[op.what]] += op.bytes_sent
    return out
