"""ZeRO-3 all-gathers of fp8 weights (train.fp8=tensorwise): 1 byte per parameter on the
wire for the blocks' linear weights, where bf16 sends 2.

torchao's float8 all-gather (`enable_fsdp_float8_all_gather`) works only through FSDP2's
extension points; this is the same idea in our units (units.py). A tensorwise Float8Linear
casts its whole weight with one scale, 448 / amax (e4m3's largest value over the weight's
largest magnitude), at every use. Each rank holds a shard of the weight, so the amax is
agreed first: every rank takes the amax of each weight's part in its shard and an
all-reduce max over the group gives the global one (one fp32 per weight: 7 per llama
block). Each rank then casts its shard with that scale to e4m3 (1 byte), the bytes are
all-gathered, and each rank dequantizes the unit into its 16-bit flat buffer (q / scale).

Why the numbers are the single process's: the global amax is the full weight's amax, so
every element's e4m3 value q is the one the single process's Float8Linear casts from the
fp32 weight. The layer then casts the gathered values again; they are q / scale rounded to
bf16, a relative change of at most 2^-9, which e4m3's spacing (2^-3 relative; subnormals
2^-9 absolute) rounds back to the same q. Only the scale it recomputes from them may differ
from the single process's by that 2^-9, as it does for ZeRO-3's plain bf16 gather.

Which units (cost/fp8.py `fp8_gathers` is the rule the planner shares): under bf16 (a
split unit: units.py) the rounded half of a block unit holds exactly the block's converted
weights; the head's rounded half (never converted) and every kept half travel as before.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from shardtrain.comm import Communicator, Handle
from shardtrain.parallel.zero.units import FlatUnit, UnitComm

E4M3 = torch.float8_e4m3fn


class Float8GatherComm(UnitComm):
    """A UnitComm whose gathers of units made only of `fp8_names` (the converted weights'
    full-model names, quant/float8.py `convert_blocks`) move e4m3 bytes and per-weight
    scales agreed by an all-reduce max (module docstring); every other call is UnitComm's."""

    def __init__(self, comm: Communicator, *, fp8_names: Collection[str],
                 grad_scale: float = 1.0):
        super().__init__(comm, grad_scale=grad_scale)
        self.fp8_names = frozenset(fp8_names)

    def in_fp8(self, unit: FlatUnit) -> bool:
        return unit.sharded and all(name in self.fp8_names for name in unit.names)

    def gather_params(self, unit: FlatUnit, full: torch.Tensor, shard: torch.Tensor, *,
                      phase: str, async_op: bool = True) -> Handle:
        if not self.in_fp8(unit):
            return super().gather_params(unit, full, shard, phase=phase, async_op=async_op)
        return self.comm.composite(lambda: float8_all_gather(self.comm, unit, full, shard),
                                   async_op=async_op)


@torch.no_grad()
def float8_all_gather(comm: Communicator, unit: FlatUnit, full: torch.Tensor,
                      shard: torch.Tensor) -> None:
    """full [padded] (16-bit) <- the unit's weights, sent as e4m3 with one scale per weight
    from the global amax (module docstring); torchao's scale and saturating cast."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    runs = unit.shard_runs(lambda i: True)  # (weight, start, end) within this shard
    amax = torch.zeros(len(unit.params), dtype=torch.float32, device=shard.device)  # [W]
    for i, a, b in runs:
        amax[i] = shard[a:b].abs().max()
    comm.all_reduce(amax, "max", tag="param:amax")  # the whole weights' amax, [W]
    scale = amax_to_scale(amax, E4M3)  # [W] fp32, as Float8Linear computes it
    q = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)  # [shard], padding 0
    for i, a, b in runs:
        q[a:b] = to_fp8_saturated(shard[a:b].float() * scale[i], E4M3)
    gathered = torch.empty(unit.padded, dtype=torch.uint8, device=shard.device)  # [padded]
    comm.all_gather(gathered, q.view(torch.uint8), tag="param:fp8")
    values = gathered.view(E4M3)
    for i, (p, off) in enumerate(zip(unit.params, unit.offsets)):
        n = p.numel()
        full[off:off + n] = (values[off:off + n].float() / scale[i]).to(full.dtype)
