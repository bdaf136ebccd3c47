"""Where ZeRO-3 gathers weights in fp8 (train.fp8; parallel/zero/fp8_gather.py), and how
many weights each gather agrees a scale for: the one rule the runtime and the planner's
traffic (plan/traffic.py) share. Pure arithmetic."""

from __future__ import annotations

from shardtrain.config import ModelConfig


def fp8_gathers(*, fp8: str, zero: int, sixteen_bit: bool, zeropp: bool,
                partition: str, tp: int = 1) -> bool:
    """Whether the blocks' converted weights are all-gathered in e4m3: tensorwise only (one
    scale per weight, the same for the forward's and the backward's use; rowwise scales
    each weight along a different dimension in forward and backward), ZeRO-3's flat
    partition (the layer partition broadcasts whole units from their owner), under a 16-bit
    compute dtype (the unit split that puts the converted weights alone in their half:
    parallel/zero/units.py), and not under ZeRO++'s own gathers (hpZ, qgZ's comm). Not under
    tensor parallelism either: a rank's unit holds tp slices, whose single-process scale
    needs the amax agreed over tp as well as dp, and the gathers run on the dp group's
    background lane, where a tp collective would interleave with the tp group's own (the
    layer then casts the bf16-gathered slice with the tp-agreed scale, quant/float8_tp.py)."""
    return (fp8 == "tensorwise" and zero == 3 and sixteen_bit and not zeropp
            and partition == "flat" and tp == 1)


def converted_per_block(cfg: ModelConfig) -> int:
    """Linear weights quant/float8.py converts in one block: q, k, v, o and the MLP's w1,
    w2 (and w3 where it is gated: llama). Each gets one fp32 amax in the gather's
    all-reduce max."""
    return 4 + (3 if cfg.style == "llama" else 2)
