"""Tensor parallelism of multi-head latent attention (model/mla.py): heads split, latents whole.

The attention region (layers.py `Region`: `f` on entry, `g` after wo) holds, per rank:
- the per-head projections split by heads, H / t heads each: wq (or the q bottleneck's
  up-projection wq_b) and wkv_b column-parallel (their rows are head-major: [H x D] and
  [H x (Dn + Dv)]), wo row-parallel over its [H x Dv] inputs;
- the down-projections to the latents (wq_a, wkv_a, the shared RoPE key's rows included)
  and the latent RMSNorms whole on every rank: each rank computes the same latents from
  the same input, and its heads' share of their gradients, which are summed over tp
  (placement `partial`), as Qwen3's per-head norms' are. Their input gradients are parts
  too, summed by `f`'s backward all-reduce with the rest of the region's.
wq_a and wkv_a read the region's input (under sp the gathered sequence: they save only
the sequence chunk, as every column-parallel linear does); wq_b and wkv_b read the latent
each rank holds whole, so they are plain linears on their head rows. No collective is
added: the region's two all-reduces (or all-gather and reduce-scatter) per layer are
MHA's, while each rank recomputes the latents (2 x C x (q_lora_rank + kv_lora_rank +
qk_rope_head_dim) FLOPs per token more than a split would cost, small beside the heads').
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.model.mla import LatentAttention
from shardtrain.parallel.tensor.layers import ColumnParallelLinear, Region, RowParallelLinear
from shardtrain.parallel.tensor.sharding import Placement

# split(name, full, dim, parts, index, partial) -> this rank's block (layers.py's closure)
Split = Callable[..., torch.Tensor]


def shard_latent(attn: LatentAttention, prefix: str, region: Region, comm: Communicator,
                 split: Split, places: dict[str, Placement], *, sp: bool) -> None:
    """Swap `attn`'s linears for their tp versions in place (module docstring); `prefix`:
    its full name with a trailing dot."""
    whole = dict(parts=1, index=0, partial=True)
    if attn.wq is not None:
        attn.wq = ColumnParallelLinear(split(prefix + "wq.weight", attn.wq.weight, 0), None,
                                       region)
    else:
        attn.wq_a = ColumnParallelLinear(
            split(prefix + "wq_a.weight", attn.wq_a.weight, 0, **whole), None, region)
        _heads(attn.wq_b, split(prefix + "wq_b.weight", attn.wq_b.weight, 0))
    attn.wkv_a = ColumnParallelLinear(
        split(prefix + "wkv_a.weight", attn.wkv_a.weight, 0, **whole), None, region)
    _heads(attn.wkv_b, split(prefix + "wkv_b.weight", attn.wkv_b.weight, 0))
    attn.wo = RowParallelLinear(split(prefix + "wo.weight", attn.wo.weight, 1), None, comm,
                                sp=sp)
    for norm in ("q_a_norm", "kv_a_norm"):
        if getattr(attn, norm) is not None:
            places[f"{prefix}{norm}.weight"] = Placement(partial=True)


def _heads(linear: nn.Linear, rows: torch.Tensor) -> None:
    """`linear` keeps only this rank's head rows [out/t, in] (its input is whole here)."""
    linear.weight = nn.Parameter(rows)
    linear.out_features = rows.shape[0]
