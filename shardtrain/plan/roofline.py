"""The roofline of one rank's step: each kind of op at max(FLOPs / achievable FLOP/s,
bytes / memory bandwidth) (Williams, Waterman and Patterson 2009, sections 1-3: a compute
ceiling and a bandwidth ceiling; seeds 002 section 5.3 and 003).

An op whose FLOPs per byte (arithmetic intensity) is above the ridge point, peak x
efficiency / memory_bw (A100 80GB bf16: 312e12 x 0.7 / 2.039e12 = 107 FLOP/byte), is
compute-bound; below it, memory-bound. The linears and the attention core carry the step's
hardware FLOPs (cost/counts.py, exactly: their FLOPs here sum to hardware FLOPs / GPUs) and
at training shapes sit far above the ridge; norms, residual adds, the activation function,
rotary embeddings, a softmax the attention kernel does not fuse (attention=math), the
embedding lookup, the loss's softmax over the vocabulary and the optimizer step do a few
FLOPs per element and are priced by the bytes they read and write.

Per rank, per step (the compute term's convention: work spread evenly over the GPUs, so
L / pp layers and 1 / pp of the embedding, head and loss), T = micro_batch x seq / cp
tokens per micro-batch, T / tp for the residual-width ops under sp. Bytes are read +
written once per pass (an ideal cache: each tensor streams through HBM once): the forward
once, the backward twice the forward (it reads the output's gradient and what the forward
saved and writes the input's gradient), recomputation once more for what it reruns (full:
every op of the block; selective: the attention core, with its softmax under math).
Element sizes: `stream` for the residual stream (norms, residual adds, embedding: the
parameters' dtype, fp32 under amp), `act` for what the linears produce (2 under bf16 and
amp, 4 under fp32); the loss writes fp32 log-probabilities. The optimizer step (AdamW)
reads the gradient, the weights it updates (the fp32 master, or the parameters) and the
state, and writes the weights, the state and the 16-bit copy where a master exists, for
the rank's ZeRO shard; under offload it runs on the host and is not a device term.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardtrain.config import ModelConfig
from shardtrain.cost.counts import attention_core_flops_per_token, hardware_flops_per_token
from shardtrain.cost.hardware import Hardware
from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import STATE_BYTES
from shardtrain.plan.partition import rank_params

_ACT = {"bf16": 2, "amp": 2, "fp32": 4,  # what the linears (autocast) produce
        "bf16-true": 2, "fp16-true": 2}
_STREAM = {"bf16": 2, "amp": 4, "fp32": 4,  # the residual stream: the parameters' dtype
           "bf16-true": 2, "fp16-true": 2}
# FLOPs per element written: (x^2 sum, rsqrt, scale, weight) for a norm; silu x up for
# SwiGLU; exp, sum, divide for a softmax; AdamW's moments, bias correction and decay.
_NORM_FLOPS, _ACT_FLOPS, _SOFTMAX_FLOPS, _ADAM_FLOPS = 5.0, 5.0, 5.0, 12.0


@dataclass(frozen=True, kw_only=True)
class RoofOp:
    name: str
    flops: float  # per rank per step
    bytes: float  # HBM bytes read + written, per rank per step
    time_s: float  # max(flops / (peak x efficiency), bytes / memory_bw)
    bound: str  # "compute" or "memory": which ceiling sets time_s
    in_pipeline: bool = True  # False: after the pipeline (the optimizer step)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self) | {"intensity": self.intensity}


def price(name: str, flops: float, nbytes: float, hw: Hardware, precision: str, *,
          in_pipeline: bool = True) -> RoofOp:
    compute = flops / (hw.flops(precision) * hw.efficiency)
    memory = nbytes / hw.memory_bw
    return RoofOp(name=name, flops=flops, bytes=nbytes, time_s=max(compute, memory),
                  bound="compute" if compute >= memory else "memory", in_pipeline=in_pipeline)


def roofline_ops(cfg: ModelConfig, layout: Layout, hw: Hardware, *, global_batch: int,
                 seq_len: int) -> list[RoofOp]:
    """One rank's step as roofline ops (module docstring)."""
    lay, t = layout, layout.tp
    act, stream = _ACT[lay.precision], _STREAM[lay.precision]
    h, v = cfg.dim, cfg.vocab_size
    d = cfg.qk_head_dim  # mla: q and k (and the zero-padded v) after decompression
    q, kv = cfg.n_heads * d / t, cfg.kv_heads * d / t  # one tp rank
    T = lay.micro_batch * seq_len / lay.cp
    Tn = T / t if lay.sp else T  # the residual-width ops run on the sequence chunk under sp
    full, selective = lay.recompute == "full", lay.recompute == "selective"
    block_passes = 3.0 + full  # forward, backward (2x), the rerun of full recomputation
    # per rank per step: layers on this rank x micro-batches it runs
    scale = cfg.n_layers / lay.pp * lay.microbatches
    outside = lay.microbatches / lay.pp  # embedding, head and loss: one stage's, spread
    mlps = _mlp_rows(cfg, T, t)  # (rows, hidden width) of a mean block's MLPs
    mlp_linears = 3 if cfg.style == "llama" else 2  # SwiGLU: w1, w3 (h -> f) and w2 (f -> h)

    tokens = global_batch * seq_len
    core_flops = attention_core_flops_per_token(cfg, seq_len, lay.recompute, lay.attention)
    hw_flops = hardware_flops_per_token(cfg, seq_len, lay.recompute, lay.attention)
    per_rank = tokens / lay.gpus
    # linears: each layer's weights once per pass, their inputs and outputs (elements):
    # qkv [T, h] -> [T, q + 2 kv], wo [T, q] -> [T, h], the MLP's up and down projections
    params = rank_params(cfg, lay)
    layer_io = (T * h + T * (q + 2 * kv)) + (T * q + T * h) \
        + sum(rows * ((mlp_linears - 1) * (h + w) + (w + h)) for rows, w in mlps)
    head_io = v / t * h + T * (h + v / t)
    linear_bytes = act * (block_passes * scale * (params.layer + layer_io)
                          + 3.0 * outside * head_io)
    # attention core: q, k, v in, out written (flash); math also writes and reads the scores
    scores = T * (cfg.n_heads / t) * seq_len  # [b, H/t, s/cp, s] elements
    core_io = T * (2 * q + 2 * kv) + (2 * scores if lay.attention == "math" else 0.0)
    core_passes = 3.0 + (1.0 if full or (selective and lay.attention != "math") else 0.0)
    ops = [price("linears", (hw_flops - core_flops) * per_rank,
                 linear_bytes, hw, lay.precision),
           price("attention core", core_flops * per_rank,
                 act * core_passes * scale * core_io, hw, lay.precision)]
    # memory-bound kinds: (name, elements written per rank per step, bytes per element
    # written (reads included), FLOPs per element)
    rope = T * (q + kv) if cfg.style == "llama" else 0.0
    activation_read = 2 if cfg.style == "llama" else 1  # SwiGLU reads gate and up
    softmax_passes = 3.0 + (full or selective)
    tables = 2 if cfg.style == "gpt2" else 1  # gpt2: token and position rows, then an add
    elementwise = [  # blocks' norms and the final one (one stage's, spread over pp)
        ("norms", (2 * scale * block_passes + 3.0 * outside) * Tn * h, 2 * stream, _NORM_FLOPS),
        ("residual adds", 2 * scale * block_passes * Tn * h, 3 * stream, 1.0),
        ("activation", scale * block_passes * sum(r * w for r, w in mlps),
         (activation_read + 1) * act,
         _ACT_FLOPS),
        ("rotary", scale * block_passes * rope, 2 * act, 3.0),
        ("softmax", scale * softmax_passes * scores if lay.attention == "math" else 0.0,
         2 * act, _SOFTMAX_FLOPS),
        ("embedding", outside * 3.0 * T * h, (2 * tables + 3 * (tables - 1)) * stream, 1.0),
        ("loss softmax", outside * 2.0 * T * v / t, act + 4, _SOFTMAX_FLOPS),
    ]
    for name, elements, per_element, flops in elementwise:
        if elements:
            ops.append(price(name, elements * flops, elements * per_element, hw, lay.precision))
    if lay.offload == "none":
        p, g, master, state = STATE_BYTES[lay.precision]
        shard = params.total / (lay.nd if lay.zero >= 1 else 1)
        weights = master or p  # what the step updates: the fp32 master, else the parameters
        per_param = g + 2 * weights + 2 * state + (p if master else 0)
        ops.append(price("optimizer", shard * _ADAM_FLOPS, shard * per_param, hw,
                         lay.precision, in_pipeline=False))
    return ops


def _mlp_rows(cfg: ModelConfig, tokens: float, t: int) -> list[tuple[float, float]]:
    """The MLPs of a block averaged over the model's blocks, as (rows, hidden width per tp
    rank): a dense MLP's `tokens` rows of ffn_hidden / t; a MoE block's k routed slots per
    token through experts of expert_hidden and its shared experts on every token (whole on
    every tp rank, parallel/tensor/layers.py); model.moe_first_dense mixes the two."""
    moe = cfg.moe_layers / cfg.n_layers
    rows = [(tokens * (1 - moe), cfg.ffn_hidden / t)] if moe < 1 else []
    if moe:
        rows.append((tokens * cfg.moe_top_k * moe, cfg.expert_hidden))
        if cfg.moe_shared_experts:
            rows.append((tokens * moe, cfg.moe_shared_experts * cfg.expert_hidden))
    return rows


def split(ops: list[RoofOp]) -> tuple[float, float]:
    """(compute-bound seconds, memory-bound seconds) of a step's ops."""
    return (sum(o.time_s for o in ops if o.bound == "compute"),
            sum(o.time_s for o in ops if o.bound == "memory"))
