"""FP8 training of the transformer blocks' linear layers (train.fp8), through torchao's
float8 training (`torchao.float8`, the `fp8` extra).

Each `nn.Linear` of a block (attention q, k, v, o; the MLP's w1, w3, w2) becomes torchao's
`Float8Linear`: its forward casts the input and the weight to float8 e4m3 with a scale per
tensor (`tensorwise`) or per row of the matmul's operand (`rowwise`), multiplies them in
`torch._scaled_mm`, and its backward casts the output gradient to e5m2 (tensorwise) or e4m3
(rowwise) for the two gradient matmuls (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"; the recipes are torchao's `Float8LinearRecipeName`). The weight stays the fp32
parameter it was: the optimizer, the checkpoint and the ZeRO shards see the same tensor
under the same name, and only the matmuls read its fp8 copy, made again at every use.

What stays as it is, and why (docs/precision.md, "FP8"):
- the embedding is a table look-up, no matmul; norms are element-wise;
- the head's logits feed the softmax over the vocabulary, where fp8's 3 mantissa bits would
  round the differences between logits that the loss reads (torchao and torchtitan leave
  the output projection in bf16 too);
- an MoE router's scores choose experts: a rounding flips a choice, not an error of 2^-4.

Under tensor parallelism the blocks' linears are our column- and row-parallel modules, not
nn.Linear: `convert_blocks` has them run their matmuls with the same recipe, each scale's
amax agreed over tp where the rank holds a slice of what it spans (float8_tp.py).

Scales are dynamic (from the current amax of each cast tensor), so a conversion holds no
state: conversion on the meta device before materialisation (parallel/parallelize.py) keeps
every parameter object and name, and no buffer appears.

On CPU, torch's `_scaled_mm` (torch >= 2.9) takes per-tensor and per-row scales, so both
recipes run torchao's own code here, with no emulation: tests/test_fp8.py checks each
against a dequantize-then-matmul reference of the same roundings. On CUDA the matmuls need
SM89 (Ada, Hopper) or later, and every dimension a multiple of 16 (config/fp8.py refuses
the rest on any device, so a config valid here is valid there).
"""

from __future__ import annotations

from torch import nn

RECIPES = ("tensorwise", "rowwise")  # train.fp8's values other than none


def float8_config(recipe: str):
    """torchao's Float8LinearConfig of a recipe name (tensorwise: e4m3 forward, e5m2
    gradients, per-tensor scales; rowwise: e4m3 throughout, per-row scales rounded to powers
    of 2)."""
    from torchao.float8 import Float8LinearConfig  # the fp8 extra: imported only when used

    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    return Float8LinearConfig.from_recipe_name(recipe)


def convert_blocks(model: nn.Module, recipe: str) -> list[str]:
    """Swap every nn.Linear inside `model.layers` (the transformer's blocks) for a
    Float8Linear of `recipe`, in place (on the meta device too: the weight and bias objects
    move over unchanged); a tensor-parallel linear there (`use_float8`) keeps its module and
    runs its matmul in fp8 with the same recipe, scales agreed over tp (float8_tp.py).
    Returns the converted weights' full names ("layers.0.attn.wq.weight", ...). Only the
    blocks: the head and the embedding stay outside (module doc)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = float8_config(recipe)
    names = []
    for i, block in model.layers.named_children():  # an MoE router would stay (module
        # doc); config/fp8.py refuses MoE
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=lambda mod, fqn: "router" not in fqn)
        for name, m in block.named_modules():
            if hasattr(m, "use_float8"):  # a tensor-parallel linear: fp8 with agreed scales
                m.use_float8(config)  # (parallel/tensor/layers.py, float8_tp.py)
            if isinstance(m, Float8Linear) or getattr(m, "fp8", None) is not None:
                names.append(f"layers.{i}.{name}.weight")
    return names
