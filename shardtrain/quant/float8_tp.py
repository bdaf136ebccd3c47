"""FP8 matmuls of the tensor-parallel linears (parallel/tensor/layers.py) under train.fp8,
with the recipe of the converted nn.Linear (float8.py) and its scales agreed over the tp
group, so that every element is cast with the scale the single process gives it.

A dynamic fp8 scale is taken from the amax of the values it scales: the whole tensor
(tensorwise) or one row of the matmul operand along the dimension the amax reduces
(rowwise: torchao's "axiswise" dim). A rank holds a slice of some operands; where the
amax reduces over the split dimension, the rank's own amax is that of its slice, not of
the logical tensor, so it is all-reduced (max) over the tp group first. Where the amax
reduces along a dimension the rank holds whole, the rows are whole on the rank and need no
agreement. With x [M, K] the input (M tokens), w_t [K, N] the weight transposed and go
[M, N] the output gradient, the matmuls are out = x w_t, grad_x = go w_t^T and grad_w =
go^T x, and torchao's six casts reduce along (tensorwise: everything):

| cast (torchao's name)         | rowwise: amax along | column (N split) | row (K split) |
|---|---|---|---|
| input                         | K (per token)        | whole            | agreed [M]    |
| weight                        | K (per output unit)  | whole            | agreed [N]    |
| grad_output                   | N (per token)        | agreed [M]       | whole         |
| weight_for_grad_input         | N (per input unit)   | agreed [K]       | whole         |
| grad_output_for_grad_weight   | M (per output unit)  | whole            | whole         |
| input_for_grad_weight         | M (per input unit)   | whole            | whole         |

Tensorwise agrees every split operand's one amax: column w_t and go, row x and w_t; the
backward reuses the forward's agreed amaxes of x and w_t (the same tensors: torchao
recomputes the same values). Per linear and micro-batch: tensorwise, a column-parallel
linear all-reduces 1 fp32 forward (w) and 1 backward (go), a row-parallel one 2 forward (x,
w); rowwise, a column one M + K fp32 backward, a row one M + N forward. Each set is one
all-reduce (plan/tensor_traffic.py counts them). Under sequence parallelism a linear's x
and go are the gathered sequence, so M is whole on every rank as without sp.

Casting, scales and matmuls are torchao's own (`tensor_to_amax`, `amax_to_scale`,
`hp_tensor_and_scale_to_float8`, `torch.mm` on its Float8TrainingTensor, which runs
`_scaled_mm`), in the order of torchao's `matmul_with_hp_or_float8_args`, so a linear held
whole (tp = 1) gives the same bits. Pure tensor code: the all-reduce comes in as `agree`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.autograd import Function

if TYPE_CHECKING:  # the fp8 extra, imported where it is used
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, LinearMMConfig

# The dimension of each 2-D operand the tp group splits, per kind of linear (module doc)
SPLIT = {"column": {"weight": 1, "grad": 1}, "row": {"input": 1, "weight": 0}}
Amaxes = dict[tuple[str, "int | None"], torch.Tensor]  # (operand, rowwise axis) -> amax


@dataclass
class Float8Tp:
    """How one tensor-parallel linear casts to fp8: its recipe (float8.py `float8_config`),
    which dimension the tp group splits (`kind`: column or row) and the group's all-reduce
    max of a flat fp32 tensor (`agree`)."""

    config: Float8LinearConfig
    kind: str
    agree: Callable[[torch.Tensor], torch.Tensor]
    mm: LinearMMConfig = field(init=False)  # the three matmuls' settings, as Float8Linear's

    def __post_init__(self):
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        if self.kind not in SPLIT:
            raise ValueError(f"a tensor-parallel linear is column or row, not {self.kind!r}")
        c = self.config
        gemm = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        self.mm = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False,
                                                  c.pad_inner_dim) for g in gemm))

    def agreed(self, operand: str, axis: int | None) -> bool:
        """Whether the amax of `operand` along `axis` (None: the whole tensor) spans the
        dimension this linear's tp group splits (module doc's table)."""
        split = SPLIT[self.kind].get(operand)
        return split is not None and (axis is None or axis % 2 == split)

    def cast(self, casts: list[tuple[torch.Tensor, str, str, int]], known: Amaxes
             ) -> tuple[list[Float8TrainingTensor], Amaxes]:
        """Float8TrainingTensors of `casts`, each (2-D tensor, operand, torchao cast name,
        rowwise axis), with the amaxes that span the split agreed in one all-reduce; and
        every (operand, axis)'s amax, `known`'s (the forward's, reused by the tensorwise
        backward) and the new ones. A new dict: torch.compile traces no mutation here."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import GemmInputRole, \
            hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        amaxes, plan, fresh = dict(known), [], []
        for t, operand, name, axis in casts:
            cc = getattr(self.config, f"cast_config_{name}")
            axis = axis if cc.scaling_granularity is ScalingGranularity.AXISWISE else None
            key = (operand, axis)
            if key not in amaxes:
                amaxes[key] = tensor_to_amax(t, scaling_granularity=cc.scaling_granularity,
                                             axiswise_dim=axis)
                if self.agreed(operand, axis):
                    fresh.append(key)
            plan.append((t, key, cc, axis))
        if fresh:  # [sum of the amaxes' sizes] fp32: exact for bf16 and fp32 values
            flat = self.agree(torch.cat([amaxes[k].float().reshape(-1) for k in fresh]))
            for k, part in zip(fresh, flat.split([amaxes[k].numel() for k in fresh])):
                amaxes[k] = part.reshape(amaxes[k].shape).to(amaxes[k].dtype)
        role = {"input": GemmInputRole.INPUT, "weight": GemmInputRole.WEIGHT,
                "grad": GemmInputRole.GRAD_OUTPUT}
        return [hp_tensor_and_scale_to_float8(
                    t, amax_to_scale(amaxes[key], cc.target_dtype,
                                     round_scales_to_power_of_2=self.config.
                                     round_scales_to_power_of_2),
                    cc.target_dtype, self.mm, role[key[0]], axis)
                for t, key, cc, axis in plan], amaxes


class Float8TpMatmul(Function):
    """x w^T of a tensor-parallel linear in fp8 (module doc): forward(x [..., K], weight
    [N, K] (this rank's slice), spec, chunk, rebuild) -> [..., N]. Sequence parallelism
    saves the input's sequence `chunk` for backward, which gathers x again by `rebuild`
    (chunk None: x is saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, spec: Float8Tp,
                chunk: torch.Tensor | None = None,
                rebuild: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        ctx.save_for_backward(x if chunk is None else chunk, weight)
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        (xq, wq), amaxes = spec.cast([(rows, "input", "input", -1),
                                      (weight.t(), "weight", "weight", 0)], {})
        ctx.spec, ctx.rebuild, ctx.amaxes = spec, rebuild, amaxes
        return torch.mm(xq, wq).reshape(*x.shape[:-1], -1)  # [..., N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, weight = ctx.saved_tensors
        x = saved if ctx.rebuild is None else ctx.rebuild(saved)
        go, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # [M, N] [M, K]
        w_t = weight.t()  # [K, N]
        (goq, wq, go0, x0), _ = ctx.spec.cast(  # one agreement for the backward's casts
            [(go, "grad", "grad_output", -1), (w_t, "weight", "weight_for_grad_input", -1),
             (go, "grad", "grad_output_for_grad_weight", 0),
             (rows, "input", "input_for_grad_weight", 0)], ctx.amaxes)
        grad_x = torch.mm(goq, wq.t()).reshape(*grad.shape[:-1], -1)  # [..., K]
        grad_w = torch.mm(go0.t(), x0)  # [N, K]
        return grad_x, grad_w, None, None, None
