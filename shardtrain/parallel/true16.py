"""The update of 16-bit weights without a master copy (train.precision = bf16-true |
fp16-true): every optimizer -- the replicated layouts' (train/optim.py `Optimizer16`) and
ZeRO's shard optimizer (zero/optim.py) -- writes its step through `update_16bit`.

The weight w is held in 16 bits and the moments in fp32 (seed 004's 12 bytes per parameter:
2 + 2 + 8). A step widens the weight to an fp32 transient, runs the fp32 arithmetic of
zero/optim.py `update_shard` on it, and writes it back rounded (`optim.bf16_update`):

- nearest: round to nearest even. An update smaller than half a unit in the last place
  of w (|w| 2^-8 in bf16) is lost entirely: that is where pure bf16 training drifts.
- stochastic: round up with a probability equal to the distance to the lower neighbour,
  so the rounding is unbiased and small updates survive on average (Gupta et al. 2015,
  "Deep Learning with Limited Numerical Precision"; Zamirai et al. 2020, "Revisiting
  BFloat16 Training"). Done on the bits: 16 random bits are added below bf16's mantissa
  in w's fp32 pattern, then the low 16 bits are cut. The bits come from a generator
  seeded by (train.seed, step, tensor index): every replica of the same tensor or shard
  draws the same bits, so data-parallel replicas stay bitwise equal.
- kahan: a bf16 compensation buffer c per parameter (+2 bytes) keeps what rounding lost:
  y = update + c; w' = round(w + y); c = y - (w' - w) (Kahan summation, Kahan 1965; as
  Zamirai et al. 2020 apply it to the weight update).

The widened copy is one tensor's (or shard's) at a time: a transient, never a held master.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LOW16 = 0xFFFF  # the fp32 mantissa bits below bf16's 7


def stochastic_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x [n] fp32 rounded stochastically to bf16 (module docstring): unbiased, E = x."""
    bits = x.contiguous().view(torch.int32)  # [n] the fp32 patterns
    noise = torch.randint(0, _LOW16 + 1, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)  # [n] uniform below bf16's mantissa
    # Adding to the pattern moves the magnitude up (sign-magnitude), carrying into the
    # exponent where the mantissa overflows; cutting the low bits then truncates toward
    # zero: up with probability (low bits) / 2^16.
    cut = (bits + noise) & ~_LOW16
    return cut.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def round_seed(seed: int, step: int, index: int) -> int:
    """The stochastic rounding's seed for tensor (or shard) `index` at `step`: the same on
    every replica, different for every step and tensor."""
    return ((seed * 1_000_003 + step) * 65_537 + index) & (2**63 - 1)


@torch.no_grad()
def update_16bit(weight: torch.Tensor, step: Callable[[torch.Tensor], None], *, mode: str,
                 seed: int = 0, compensation: torch.Tensor | None = None) -> None:
    """One step on a 16-bit weight [n] (a flat view), in place: `step` applies the fp32
    arithmetic (zero/optim.py `update_shard` with the fp32 moments) to a widened copy, which
    is written back rounded by `mode` (optim.bf16_update; fp16 weights: nearest). `seed`:
    stochastic's (`round_seed`); `compensation` [n] bf16: kahan's buffer."""
    wide = weight.float()  # [n] the transient fp32 copy
    new = wide.clone()
    step(new)
    if weight.dtype != torch.bfloat16:
        mode = "nearest"
    if mode == "kahan":
        assert compensation is not None, "kahan keeps a compensation buffer per parameter"
        y = new.sub_(wide).add_(compensation)  # [n] the update plus what was lost before
        weight.copy_(wide + y)  # rounded to nearest
        compensation.copy_(y.sub_(weight.float().sub_(wide)))  # what this rounding lost
    elif mode == "stochastic":
        g = torch.Generator(device=weight.device)
        g.manual_seed(seed)
        weight.copy_(stochastic_bf16(new, g))
    else:
        weight.copy_(new)  # round to nearest even
