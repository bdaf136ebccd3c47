"""Memory per GPU: model states (ZeRO), activations (Korthikanti Table 2), buffers.

Model states per parameter (Rajbhandari et al. 2020, FORMULAS.md), N_d = dp x cp; the
optimizer term is 4 bytes per fp32 state of the layout's `optim` (plan/optim_states.py: Adam
2, RMSProp, AdaGrad and momentum 1, vanilla SGD 0), Adam's below:
- bf16 mixed precision with Adam: params 2, grads 2, `master` 4 (the fp32 copy) and
  `optimizer` 8 (Adam m and v): master + optimizer = K = 12, 16 bytes in all.
- fp32 with Adam: params 4, grads 4, optimizer 8 (m, v), master 0.
- `amp`, what shardtrain's runtime holds under train.precision = bf16 or fp16 (the
  precision policy, parallel/precision.py): fp32 parameters that are their own master
  weights, fp32 gradients, compute under autocast: the fp32 bytes, 4 + 4 + 0 + 8. The
  published figures (the paper's and Megatron's bf16 row) keep the `bf16` convention.
- `bf16-true`, `fp16-true`: 2 + 2 + 0 + 8 (seed 004's 12 bytes; plan/state_bytes.py).
- ZeRO-1 shards master + optimizer over N_d, ZeRO-2 the gradients too, ZeRO-3 also the
  parameters. Offload (cpu: to host memory, nvme: to NVMe; the same bytes, in different
  places) moves the sharded optimizer state and an fp32 master shard off the GPU (4 bytes
  per sharded parameter: where the parameters are their own fp32 master, the host keeps the
  copy the step updates), and under ZeRO-3 the parameter shards too, as ZeRO-Infinity does:
  fp32 ones are that master (no extra bytes), a 16-bit one (the bf16 convention) is kept
  beside it; under ZeRO-2 and 3 the gradient shards too (the step reads them on the host).
  ZeRO-1 and 2 keep their full parameters on the device by definition. All of it is reported
  under `offloaded`, not in `total` (`offload_states`); `host` is what of it host memory
  holds, plus a save's staging pool (plan/checkpoint_io.py; evaluate.py `fits` checks it
  against the node's).
Activations, per layer and micro-batch: under the `bf16` convention the published forms
of Korthikanti et al. 2022 (Megatron-LM's kernels: 16-bit values, stored attention
probabilities, 1-byte dropout masks; closed_form.py `activation_bytes_per_layer`); under `fp32` and
`amp` what shardtrain's own block keeps, counted tensor by tensor and equal to the
runtime's measurement (plan/activations.py, with the layout's `attention` kernel and
context-parallel mode). Times the layers of the first stage, times the micro-batches it
holds in flight (m under GPipe, min(m, p) under 1F1B, (1 + (p-1)/(p v)) x min(m, p)
interleaved); full recomputation adds one layer's full activations, rebuilt during its
backward. cp splits the sequence: s -> s / cp. Activation offload (activation_offload.py)
keeps a two-layer window of them on the device and the rest in `offloaded` and `host`.
Under fp32 and amp without a pipeline (shardtrain's runtime) activations also count what
the head and the loss keep (`activations.head_activation_bytes`: the loss's fp32 [n, V/t]
log-probabilities above all), and buffers are the largest of backward's moments
(buffers.py): the loss's two gradients [n, V/t]; under ZeRO-2/3 the full gradients the
reducer's buckets hold (comm.bucket_mb), the head's gathered weight and gradient, two
gathered blocks (ZeRO-3), the embedding's gradients at backward's end; under DP and ZeRO-1
the larger of the loss's and two gradient buckets' copies; under amp autocast's 16-bit
copies of the weights it rounds, which the linears keep for backward. Otherwise (the published `bf16`
convention, pipelines): two gradient buckets when gradients are synchronised (DDP's 25 MB
default), for ZeRO-3 two layers of gathered parameters (current + prefetched; under amp
the weights autocast rounds gathered in 16 bits, `zero3_gather_bytes`) and one layer of
full gradients; with pp > 1, ZeRO-2 and 3 instead hold the stage's full gradients (and
ZeRO-3 its full parameters) from the step's first micro-batch to its reduce-scatter
(zero/model.py): the step's peak is ZeRO-1's, the sharded states are what stays between
steps (so does parallel.zero_accumulate = unsharded, plan/accumulate.py, on top of the
moments above); and for pp > 1 a send and a receive buffer of one boundary activation.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.config import ModelConfig
from shardtrain.plan.activation_offload import offload_terms
from shardtrain.cost.counts import kept_params
from shardtrain.plan.activations import (head_activation_bytes, layer_activation_bytes,
                                         mean_layer_activation_bytes, mtp_activation_bytes)
from shardtrain.plan.state_bytes import (REDUCE_BYTES, STATE_BYTES,  # noqa: F401 (their home)
                                         compensation_bytes, wire_grad_bytes)
from shardtrain.plan.buffers import (block_units, gathered_units, loss_moment, weight_casts,
                                     zero_moments)
from shardtrain.plan.checkpoint_io import checkpoint_staging_bytes
from shardtrain.plan.layout import Layout
from shardtrain.plan.optim_states import OPTIM_STATES
from shardtrain.plan.partition import RankParams, rank_params
from shardtrain.plan.schedule_terms import schedule_terms

BUCKET_BYTES = 25e6


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    params: float
    grads: float
    master: float
    optimizer: float
    offloaded: float = 0.0  # off the device: host memory or NVMe (not in total)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    def __add__(self, other: ModelStates) -> ModelStates:
        return ModelStates(params=self.params + other.params, grads=self.grads + other.grads,
                           master=self.master + other.master,
                           optimizer=self.optimizer + other.optimizer,
                           offloaded=self.offloaded + other.offloaded)


def offload_states(states: ModelStates, *, shard_params: float, zero: int) -> ModelStates:
    """`states` with parallel.offload (cpu or nvme) on (module docstring): the optimizer
    state and an fp32 master shard of `shard_params` elements move to `offloaded`, under
    ZeRO-2 and 3 the gradient shards, and under ZeRO-3 the parameter shards do too. The
    runtime's ledger to the byte (zero/offload.py HostOptimizer.memory, zero/model.py
    ZeroModel.memory)."""
    master = states.master or 4 * shard_params  # fp32 parameters: the host's master copy
    offloaded = master + states.optimizer
    params, grads = states.params, states.grads
    if zero == 3:
        offloaded += states.params if states.master else 0  # a 16-bit copy beside the master
        params = 0
    if zero >= 2:  # the reduced gradient shard goes to its host buffer (zero/offload.py)
        offloaded, grads = offloaded + grads, 0
    return ModelStates(params=params, grads=grads, master=0, optimizer=0,
                       offloaded=states.offloaded + offloaded)


def zero3_gather_bytes(params: float, kept: float, precision: str) -> float:
    """Bytes of one ZeRO-3 gather of `params` parameters: under amp the weights autocast
    rounds travel in 16 bits and the `kept` rest in fp32 (zero/units.py), otherwise the
    precision's parameter bytes."""
    if precision == "amp":
        return 2 * (params - kept) + 4 * kept
    return STATE_BYTES[precision][0] * params


def zero3_widths(cfg: ModelConfig, layout: Layout, ranks: RankParams) -> dict[str, float]:
    """Bytes per gathered parameter of a block unit (`gather_bytes`) and of the head's unit
    (`head_gather`) under ZeRO-3: amp gathers the weights autocast rounds in 16 bits (an
    untied head's too; a tied table is kept in fp32), the rest in the parameters' bytes."""
    width = STATE_BYTES[layout.precision][0]
    if layout.precision != "amp":
        return {"gather_bytes": width, "head_gather": width}
    kept_layer, kept_expert, _ = kept_params(cfg)
    kept = kept_layer / layout.tp + kept_expert / layout.ep  # of one block on this rank
    return {"gather_bytes": zero3_gather_bytes(ranks.layer, kept, "amp") / ranks.layer,
            "head_gather": width if cfg.tie_embeddings else 2}


def replicas_per_node(layout: Layout, node_size: int) -> int:
    """The ZeRO group's ranks (`Layout.nd`) on one node (tp innermost: they sit tp apart)."""
    return max(1, min(layout.nd, node_size // layout.tp))


def model_states(params: float, *, nd: int = 1, zero: int = 0,
                 precision: str = "bf16", optim: str = "adamw",
                 compensation: int = 0) -> ModelStates:
    """Model-state bytes of one rank holding `params` parameters replicated over `nd`
    ranks: DP (2+2+K) Psi; ZeRO-1 4 Psi + K Psi/N_d; ZeRO-2 2 Psi + (2+K) Psi/N_d;
    ZeRO-3 (2+2+K) Psi/N_d (Rajbhandari et al. 2020, section 5; K = master + optimizer,
    the optimizer 4 bytes per fp32 state of `optim`: plan/optim_states.py, plus
    `compensation` bytes per parameter: kahan's, `compensation_bytes`)."""
    p, g, m, _ = STATE_BYTES[precision]
    o = 4 * OPTIM_STATES[optim] + compensation
    return ModelStates(params=p * params / (nd if zero >= 3 else 1),
                       grads=g * params / (nd if zero >= 2 else 1),
                       master=m * params / (nd if zero >= 1 else 1),
                       optimizer=o * params / (nd if zero >= 1 else 1))


def in_flight(schedule: str, m: int, p: int, v: int = 1) -> float:
    """Micro-batches whose activations the most loaded stage holds: the schedule
    simulator's (plan/schedule_terms.py; 1F1B min(m, p), GPipe m; Narayanan et al. 2021)."""
    return schedule_terms(schedule, p, m, v).in_flight


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    master: float
    activations: float
    activations_per_layer: float  # one layer, one micro-batch
    buffers: float
    offloaded: float  # held in host memory or on NVMe instead
    host: float = 0.0  # host memory: what of `offloaded` it holds, and a save's staging pool

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.master + self.activations
                + self.buffers)

    def to_dict(self) -> dict[str, float]:
        names = ("params", "grads", "optimizer", "master", "activations",
                 "activations_per_layer", "buffers", "offloaded", "host")
        return {n: float(getattr(self, n)) for n in names} | {"total": float(self.total)}


def _kept(ranks: RankParams, lay: Layout) -> float:
    """The full gradient (ZeRO-3: and parameters) held through a step (plan/accumulate.py)."""
    from shardtrain.plan.accumulate import kept_bytes  # (it imports this module)
    return kept_bytes(ranks.total, zero=lay.zero, precision=lay.precision,
                      kept=ranks.kept + ranks.kept_expert)


def memory_per_gpu(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                   bucket_bytes: float = BUCKET_BYTES, node_size: int = 0,
                   staging_bytes: float | None = None) -> MemoryBreakdown:
    """`node_size`: ranks per node (hpZ's secondary shard needs it); `staging_bytes`: a
    save's staging pool (checkpoint.staging_mb; None: its default), in `host`."""
    lay = layout
    ranks = rank_params(cfg, lay)
    kahan = compensation_bytes(lay.bf16_update)
    states = (model_states(ranks.dense, nd=lay.nd, zero=lay.zero, precision=lay.precision,
                           optim=lay.optim, compensation=kahan)
              + model_states(ranks.expert, nd=lay.nd // lay.ep, zero=lay.zero,
                             precision=lay.precision, optim=lay.optim, compensation=kahan))
    if lay.partition == "layer":  # the busiest rank's whole units (imports this module)
        from shardtrain.plan.layer_partition import layer_states
        states = layer_states(cfg, lay)
    if lay.ps_servers:  # the optimizer lives on the parameter servers
        states = ModelStates(params=states.params, grads=states.grads, master=0, optimizer=0)
    host = states.grads if lay.zero >= 2 else 0.0  # nvme: the gradients' host buffers
    if lay.offload != "none":  # each rank's shard: the dense over N_d, experts over N_d / ep
        shard = ranks.dense / lay.nd + ranks.expert / (lay.nd // lay.ep)
        states = offload_states(states, shard_params=shard, zero=lay.zero)
    host = {"none": 0.0, "cpu": states.offloaded}.get(lay.offload, host) \
        + checkpoint_staging_bytes(states, staging_bytes)  # plan/checkpoint_io.py
    if lay.qwz or lay.hpz:  # (plan/zeropp.py imports this module)
        from shardtrain.plan.zeropp import zeropp_states
        states = zeropp_states(states, lay, ranks, node_size=node_size)
    value_bytes = 4 if lay.precision == "fp32" else 2
    s = seq_len // lay.cp
    per_layer = mean_layer_activation_bytes(cfg, lay, ranks, seq_len=seq_len)
    flight = in_flight(lay.schedule, lay.microbatches, lay.pp, lay.v)
    activations = per_layer * ranks.layers * flight
    offloaded = states.offloaded
    if lay.activation_offload == "cpu":  # all but a two-layer window on the host
        off = offload_terms(per_layer, layers=ranks.layers, in_flight=flight,
                            microbatches=lay.microbatches)
        activations, host, offloaded = (off.device_bytes, host + off.host_bytes,
                                        offloaded + off.host_bytes)
    if lay.recompute == "full":
        activations += layer_activation_bytes(cfg, lay, seq_len=seq_len, recompute="none")
    # the MTP modules' (on the last stage), added to the busiest stage's: with several
    # stages an upper bound (the last one holds fewer micro-batches in flight)
    activations += flight * mtp_activation_bytes(cfg, lay, seq_len=seq_len)
    buffers = 0.0
    # shardtrain's own runtime without a pipeline: the head's activations and the step's
    # largest transient (activations.py, buffers.py)
    mine = lay.pp == 1 and lay.precision != "bf16"
    if mine:
        activations += head_activation_bytes(cfg, s=s, b=lay.micro_batch, t=lay.tp, sp=lay.sp,
                                             precision=lay.precision)
    if mine and lay.zero >= 2:  # full gradients only in the buckets
        buffers += zero_moments(cfg, lay, ranks, seq_len=seq_len, activations=activations,
                                bucket_bytes=bucket_bytes, **zero3_widths(cfg, lay, ranks))
        if lay.accumulate == "unsharded" and lay.nd > 1:  # under every moment
            buffers += _kept(ranks, lay)
    else:
        if lay.nd > 1:  # the gradient buckets' copies
            buffers += 2 * min(bucket_bytes, STATE_BYTES[lay.precision][1] * ranks.total)
        if mine:  # held at backward's end, the loss's gradients at its start; ZeRO-1
            # reduces once backward is over, its saved activations gone (zero/reducer.py)
            after = buffers - (activations if lay.zero == 1 else 0.0)
            buffers = max(after, loss_moment(cfg, lay, seq_len=seq_len))
        once = lay.pp > 1 or lay.accumulate == "unsharded"  # reduced once per step
        if lay.nd > 1 and lay.zero >= 2 and once:  # full copies held all step
            buffers += _kept(ranks, lay)
        elif lay.nd > 1 and lay.zero == 3:  # the unit's kept share taken as the rank's
            units = block_units(ranks.layers, ranks.layer, lay.unit_blocks)
            both = gathered_units(units)  # the unit computing and the next
            kept = both * (ranks.kept + ranks.kept_expert) / ranks.total
            buffers += zero3_gather_bytes(both, kept, lay.precision) \
                + max(units) * STATE_BYTES[lay.precision][1]
    if mine and lay.precision == "amp":  # held beside every moment above
        buffers += weight_casts(cfg, lay, ranks)
    if lay.pp > 1:
        boundary = value_bytes * s * lay.micro_batch * cfg.dim
        buffers += 2 * boundary / (lay.tp if lay.sp else 1)
    return MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer,
                           master=states.master, activations=activations,
                           activations_per_layer=per_layer, buffers=buffers,
                           offloaded=offloaded, host=host)

