"""The tensor-parallel group's traffic of one rank in one step (the ledger's tag "tp"), as
parallel/tensor/ sends it (Shoeybi et al. 2019; Korthikanti et al. 2022 for sp).

X = b s h elements of one micro-batch's activation (s = seq / cp), L the layers on this
rank, m micro-batches, f forwards per layer (2 under full recomputation). Region traffic
moves the compute dtype (regions are entered in it, tensor/layers.py); the embedding's
output and its gradient are the residual stream (fp32 under amp).

- Without sp, per layer: g's all-reduce of X after each of the two regions per forward,
  f's all-reduce of the input gradient per region in backward: L m (f + 3) all-reduces
  (4 without recomputation; full recomputation reruns the attention region's g but not
  the MLP's: torch's checkpoint stops recomputing at the last tensor backward needs, the
  MLP's partial output before its sum).
  The head's region adds f's one in backward.
- With sp, per layer: the regions' all-gathers (2 per forward), g's backward all-gathers
  (2) and the backward's re-gather of each region's input (2: the column-parallel
  linears keep only their sequence chunk, Korthikanti sec. 4.2.2), L m (2f + 4); the
  reduce-scatters of g forward and f backward, L m (f + 3) (the MLP's g again not
  recomputed). The head's region: two
  all-gathers (forward, re-gather) and one reduce-scatter.
- The vocabulary-parallel embedding all-reduces its output once per micro-batch (under
  sp, entering the split residual stream all-gathers its gradient back); the
  vocabulary-parallel loss all-reduces the row maxima [b s] and the sums [2, b s], fp32.
- Under train.fp8 the blocks' linears agree their fp8 scales over tp (quant/float8_tp.py,
  the ledger's "tp:amax"), per layer and micro-batch, each set one all-reduce of fp32
  amaxes: tensorwise, each column-parallel linear 1 per forward (its weight's) and 1 in
  backward (its output gradient's), each row-parallel one 1 of 2 per forward (input and
  weight); rowwise, each row-parallel linear b s + C per forward (its input's rows and its
  weight's output rows), each column-parallel one b s + C in backward (the output
  gradient's rows and the weight's input rows). Latency-bound: 4 to 12 bytes, or about
  1/C of one region all-reduce's X.
The embedding sits on the first pipeline stage and the head and loss on the last: with
pp > 1 the last stage's share is counted (the planner's busiest rank holds the head).
"""

from __future__ import annotations

from collections.abc import Callable

from shardtrain.config import ModelConfig
from shardtrain.cost.fp8 import converted_per_block
from shardtrain.plan.layout import Layout
from shardtrain.plan.ops import FREE, CommOp, Placement, collective
from shardtrain.plan.partition import rank_params


def tensor_parallel_ops(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                        where: Placement = FREE) -> list[CommOp]:
    lay, t = layout, layout.tp
    if t <= 1:
        return []
    value = 4 if lay.precision == "fp32" else 2  # the compute dtype
    resid = 2 if lay.precision == "bf16" else 4  # the residual stream (Megatron's: 16-bit)
    tokens = lay.micro_batch * (seq_len // lay.cp)
    x, m = tokens * cfg.dim, lay.microbatches
    blocks = rank_params(cfg, lay).layers * m
    f = 2 if lay.recompute == "full" else 1
    first = lay.pp == 1

    def op(name: str, nbytes: float, calls: int) -> CommOp:
        return collective("tp", name, t, nbytes, calls, where, "none")

    if lay.sp:
        ops = [op("all_gather", x * value, blocks * (2 * f + 4) + 2 * m),
               op("reduce_scatter", x * value, blocks * (f + 3) + m)]
        if first:
            ops.append(op("all_gather", x * resid, m))
    else:
        ops = [op("all_reduce", x * value, blocks * (f + 3) + m)]
    if first:
        ops.append(op("all_reduce", x * resid, m))
    ops += fp8_scale_ops(cfg, lay, tokens=tokens, blocks=blocks, forwards=f, op=op)
    return ops + [op("all_reduce", 4 * tokens, m), op("all_reduce", 8 * tokens, m)]


def fp8_scale_ops(cfg: ModelConfig, lay: Layout, *, tokens: int, blocks: int, forwards: int,
                  op: Callable[[str, float, int], CommOp]) -> list[CommOp]:
    """The fp8 scale agreements of `blocks` layer passes (module docstring): `op(name,
    bytes, calls)`. Two of each block's converted linears are row-parallel (wo, w2)."""
    if lay.fp8 == "none":
        return []
    rows = 2
    cols = converted_per_block(cfg) - rows
    if lay.fp8 == "tensorwise":
        return [op("all_reduce", 4, blocks * cols * (forwards + 1)),
                op("all_reduce", 8, blocks * rows * forwards)]
    return [op("all_reduce", 4 * (tokens + cfg.dim), blocks * (rows * forwards + cols))]
