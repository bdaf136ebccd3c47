"""Tensor and sequence parallelism, Megatron-style, applied to the plain model by swapping
modules according to a small table.

Tensor parallel (Shoeybi et al. 2019, sec. 3): attention and the MLP of each block are
parallel regions. A region is entered through `f` (ops.py) once per forward; its
column-parallel linears (wq, wk, wv; w1, w3) split their output features -- attention
heads, MLP hidden units -- so everything up to the row-parallel linear (wo; w2) is local;
the row-parallel linear's partial products leave through `g`, an all-reduce. Per layer: two
all-reduces of [B, S, C] in forward, two in backward. The embedding and the output head
split the vocabulary (vocab.py). Grouped-query attention: with n_kv_heads >= t the kv heads
are split like the query heads; with fewer, rank r holds a copy of the one kv head its
query heads use, shared by t / n_kv_heads ranks, whose gradient parts are summed
(sharding.py).

Sequence parallel (Korthikanti et al. 2022, sec. 4.2.2): the residual stream between the
regions (norms, residual adds) is split along the sequence: the embedding's output is cut
into chunks before the first block, `f` becomes an all-gather and `g` a reduce-scatter (the
same bytes as the all-reduce), the column-parallel linears keep only the sequence chunk of
their input for backward, and the head all-gathers the final norm's output. The norm
weights (and row-parallel biases) then see 1/t of the tokens: their gradients are summed
over tp. Latent attention (model.attention = mla) splits its heads the same way, its
latents whole on every rank (latent.py).

Mixture-of-experts layers are not split: every tp rank holds the router and experts whole
(expert parallelism splits the experts over ep instead, parallel/expert/) and runs the
layer on the tokens it holds: all of them (the same work on every tp rank, so the same
gradients), or under sp its sequence chunk (gradient parts summed over tp, `partial`).
Under train.fp8 the blocks' column- and row-parallel linears run their matmuls in fp8 with
the scales agreed over tp (quant/float8_tp.py): the head stays as it is, as in one process.
Rank r of the tp group holds block r of every split dimension (sharding.Placement).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from shardtrain.comm import Communicator
from shardtrain.model.experts import autocast_dtype
from shardtrain.model.mla import LatentAttention
from shardtrain.model.moe import MoE
from shardtrain.model.transformer import Block, Transformer
from shardtrain.parallel.tensor.sharding import Placement
from shardtrain.parallel.tensor.ops import (
    CopyToRegion, GatheredInput, GatherFromSequence, ReduceFromRegion, ReduceScatterToSequence,
    ScatterToSequence, all_reduce_max, handle, regather_sequence)
from shardtrain.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from shardtrain.quant.float8_tp import Float8Tp, Float8TpMatmul

# Region of a block -> {linear: how its weight is split}. kv: column, or shared kv heads.
TABLE = {
    "attn": {"wq": "column", "wk": "kv", "wv": "kv", "wo": "row"},
    "mlp": {"w1": "column", "w3": "column", "w2": "row"},
}


class Region:
    """The entry of one parallel region (attention, MLP, or the head), applied by a forward
    pre-hook on its module however many column-parallel linears read the input. The input
    enters in the compute dtype (`to_compute`): every linear of the region would round it
    so under autocast, and the region's collectives (f's all-reduce of the input gradient;
    under sp the all-gathers, forward and backward, and the reduce-scatter) then move 16-bit
    values, as Megatron's bf16 activations do. The gradient parts of the region's linears
    are then summed in that dtype, one rounding more than autocast's fp32 sum."""

    def __init__(self, comm: Communicator, *, sp: bool):
        self.comm, self.sp = handle(comm), sp
        self.chunk: torch.Tensor | None = None  # sp: this forward's input chunk [B, S/t, C]
        self.gathered: GatheredInput | None = None

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x = to_compute(x)
        if not self.sp:
            return (CopyToRegion.apply(x, self.comm), *rest)  # [B, S, C]
        # Compiled, the re-gathers are merged in the graph instead (GatheredInput).
        self.chunk = x
        self.gathered = None if torch.compiler.is_compiling() else GatheredInput(self.comm)
        return (GatherFromSequence.apply(x, self.comm, self.gathered), *rest)  # [B, S, C]

    def _leave(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.chunk = self.gathered = None


class LoRAFactors:
    """A tensor-parallel linear's share of a LoRA update (train/finetune/lora.py): scaling * x A^T
    B^T, A [r, in] and B [out, r] split as the base weight is: a column-parallel base splits
    B's rows (A whole), a row-parallel one A's columns (B whole; its products are partial
    sums, reduced with the base's). The whole factor's gradient is a part on each rank,
    summed over tp (placement `partial`). Registered on the linear, under the plain names."""

    def no_lora(self) -> None:
        self.register_parameter("lora_a", None)
        self.register_parameter("lora_b", None)

    def add_lora(self, dense: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.lora_a, self.lora_b = nn.Parameter(lora_a), nn.Parameter(lora_b)
        self.lora_scaling, self.lora_dropout = dense.scaling, dense.dropout

    def lora_update(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self.lora_dropout(x), self.lora_a)  # [B, S, r]
        return F.linear(h, self.lora_b) * self.lora_scaling


class Float8Matmul:
    """train.fp8 on a tensor-parallel linear (quant/float8.py `convert_blocks` calls
    `use_float8` on the blocks' linears, never on the head): its matmul runs in fp8 with the
    converted nn.Linear's recipe, the scales agreed over tp (quant/float8_tp.py)."""

    fp8: Float8Tp | None = None
    kind = ""  # "column" or "row": which dimension of the operands tp splits

    def use_float8(self, config) -> None:
        comm = self.region.comm if self.kind == "column" else self.comm
        self.fp8 = Float8Tp(config, self.kind, partial(all_reduce_max, comm=comm))

    def float8_linear(self, x: torch.Tensor, *sp) -> torch.Tensor:
        """x [B, S, in] -> [B, S, out] (this rank's part); `sp`: Float8TpMatmul's chunk
        and rebuild under sequence parallelism."""
        return Float8TpMatmul.apply(x, self.weight, self.fp8, *sp)


class ColumnParallelLinear(LoRAFactors, Float8Matmul, nn.Module):
    """y = x A^T + b with the rows of A (output features) split: weight [out/t, in]. Its
    input is its region's (replicated [B, S, in]); its output stays split [B, S, out/t]."""

    kind = "column"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, region: Region):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.region = region
        self.no_lora()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.region
        if self.fp8 is not None:  # under sp it saves the chunk, as _LinearOnGathered does
            y = self.float8_linear(x, r.chunk, partial(gathered_again, r.gathered, r.comm)) \
                if r.sp else self.float8_linear(x)
            y = y if self.bias is None else y + self.bias.to(y.dtype)  # as Float8Linear adds it
        elif r.sp:
            y = _LinearOnGathered.apply(x, r.chunk, self.weight, self.bias, r.comm,
                                        r.gathered)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora_a is None else y + self.lora_update(x)  # [B, S, out/t]


class RowParallelLinear(LoRAFactors, Float8Matmul, nn.Module):
    """y = sum_r x_r A_r^T + b with the columns of A (input features) split: weight
    [out, in/t]. The partial products [B, S, out] are all-reduced (`g`), or reduce-scattered
    along the sequence under sp; the bias is added once, after."""

    kind = "row"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator, *,
                 sp: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.comm, self.sp = handle(comm), sp
        self.no_lora()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.fp8 is None else self.float8_linear(x)
        # y: [B, S, out] partial sums
        if self.lora_a is not None:  # x_r A_r^T B^T: a partial sum too, reduced with the base's
            y = y + self.lora_update(x)
        y = (ReduceScatterToSequence if self.sp else ReduceFromRegion).apply(y, self.comm)
        if self.bias is None:
            return y
        return y + (self.bias if self.fp8 is None else self.bias.to(y.dtype))  # Float8Linear's


class _LinearOnGathered(Function):
    """A column-parallel linear under sp that saves its input's sequence chunk, not the
    gathered input: backward all-gathers it again (once per region, GatheredInput)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, comm: str, gathered: GatheredInput | None
                ) -> torch.Tensor:
        ctx.save_for_backward(chunk, weight)
        ctx.comm, ctx.gathered, ctx.has_bias = comm, gathered, bias is not None
        return F.linear(x, weight, bias)  # [B, S, out/t]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        chunk, weight = ctx.saved_tensors
        x = gathered_again(ctx.gathered, ctx.comm, chunk)
        x = x.to(grad.dtype).flatten(0, -2)  # [B*S, in]
        rows = grad.flatten(0, -2)  # [B*S, out/t]
        grad_w = (rows.t() @ x).to(weight.dtype)  # [out/t, in]
        grad_b = rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad @ weight.to(grad.dtype), None, grad_w, grad_b, None, None


def gathered_again(gathered: GatheredInput | None, comm: str, chunk: torch.Tensor
                   ) -> torch.Tensor:
    """A sequence-parallel region's input [B, S, C] again in backward, from this rank's
    chunk: once per region eagerly (GatheredInput), per linear when compiled."""
    return gathered.rebuild(chunk) if gathered is not None else regather_sequence(chunk, comm)


def to_compute(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype a linear would round it to (autocast's where it is on), else x."""
    return x.to(autocast_dtype(x))


def apply_tensor_parallel(model: Transformer, comm: Communicator, *, sp: bool
                          ) -> tuple[dict[str, Placement], VocabParallelCrossEntropy]:
    """Swap the model's modules for their tensor-parallel versions, in place, on the meta
    device (shapes only) or materialised (each rank keeps its slice). Returns the placement
    of every split or partially-reduced parameter, and the loss over the vocab-split logits."""
    from shardtrain.parallel.tensor.latent import shard_latent  # it imports the linears here
    t, r, cfg = comm.size, comm.rank, model.cfg
    places: dict[str, Placement] = {}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # LoRA's base

    def split(name: str, full: torch.Tensor | None, dim: int, parts: int = t,
              index: int = r, partial: bool = False) -> torch.Tensor | None:
        if full is None:
            return None
        places[name] = Placement(dim=dim, size=full.shape[dim], parts=parts, index=index,
                                 partial=partial)
        return places[name].shard(full)

    def replicate(name: str, full: torch.Tensor | None) -> torch.Tensor | None:
        """Held whole by every rank; under sp its gradient comes from 1/t of the tokens."""
        if full is not None and sp:
            places[name] = Placement(partial=True)
        return full

    shared_kv = cfg.kv_heads < t  # parts = kv heads, rank r holds kv head r * g / t
    kv_split = (cfg.kv_heads, r * cfg.kv_heads // t) if shared_kv else (t, r)
    # the blocks, and the multi-token prediction modules' blocks alike (tensor/mtp.py)
    for block_name, block in [(n, b) for n, b in model.named_modules() if isinstance(b, Block)]:
        for region_name, linears in TABLE.items():
            module = block.get_submodule(region_name)
            if isinstance(module, MoE):  # experts whole on every tp rank (docstring)
                for pname, p in module.named_parameters():
                    replicate(f"{block_name}.{region_name}.{pname}", p)
                continue
            region = Region(comm, sp=sp)
            region.attach(module)
            if isinstance(module, LatentAttention):
                shard_latent(module, f"{block_name}.attn.", region, comm, split, places, sp=sp)
                continue
            for name, kind in linears.items():
                dense, prefix = getattr(module, name), f"{block_name}.{region_name}.{name}."
                if dense is None:  # no w3 in the GELU MLP
                    continue
                if kind == "row":
                    new = RowParallelLinear(split(prefix + "weight", dense.weight, 1),
                                            replicate(prefix + "bias", dense.bias), comm, sp=sp)
                    if hasattr(dense, "lora_a"):  # A split with the input, B whole
                        new.add_lora(dense, split(prefix + "lora_a", dense.lora_a, 1),
                                     split(prefix + "lora_b", dense.lora_b, 0, 1, 0, True))
                else:
                    parts, index = kv_split if kind == "kv" else (t, r)
                    partial = parts < t
                    new = ColumnParallelLinear(
                        split(prefix + "weight", dense.weight, 0, parts, index, partial),
                        split(prefix + "bias", dense.bias, 0, parts, index, partial), region)
                    if hasattr(dense, "lora_a"):  # A whole, B split with the output
                        new.add_lora(dense, split(prefix + "lora_a", dense.lora_a, 0, 1, 0, True),
                                     split(prefix + "lora_b", dense.lora_b, 0, parts, index,
                                           partial))
                setattr(module, name, new)
    for module_name, module in model.named_modules():
        if module_name.endswith((".q_norm", ".k_norm")):  # Qwen3's per-head norms: whole,
            # but each rank normalises only its own heads: the gradients are summed over tp
            places[f"{module_name}.weight"] = Placement(partial=True)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            for pname, p in module.named_parameters():
                replicate(f"{module_name}.{pname}", p)

    emb = split("tok_emb.weight", model.tok_emb.weight, 0)
    start = r * places["tok_emb.weight"].block()  # first vocabulary row of this rank
    model.tok_emb = VocabParallelEmbedding(emb, start=start, comm=comm)
    head_region = Region(comm, sp=sp)
    model.head = ColumnParallelLinear(split("head.weight", model.head.weight, 0), None, head_region)
    head_region.attach(model.head)
    model.tie_weights()
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    if sp:  # the residual stream is split along the sequence from the first block on
        key = handle(comm)
        model.layers[0].register_forward_pre_hook(
            lambda module, args: (ScatterToSequence.apply(args[0], key), *args[1:]))
    return places, VocabParallelCrossEntropy(start=start, vocab_size=cfg.vocab_size, comm=comm)
