"""ZeRO's gradient buckets (`comm.bucket_mb`): consecutive units, in the order backward
completes them, reduce-scattered by one collective (cost/units.py `coalesce` decides which).

A model of many small units would otherwise pay one collective's latency per unit (DeepSpeed
coalesces ZeRO's gradients into `reduce_bucket_size` buckets the same way); a unit larger
than the bucket is reduced alone, as it is, with no copy. Each rank's shard of a unit is
its r-th equal chunk, so a bucket lays out its units' gradients rank-chunk by rank-chunk:
[size, numel], row r holding rank r's chunk of every unit end to end. One reduce-scatter of
it leaves each rank a [numel] row that is its shards of the bucket's units, end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtrain.cost.units import coalesce
from shardtrain.parallel.zero.units import FlatUnit, UnitComm


@dataclass(eq=False)
class Bucket:
    units: list[FlatUnit]
    offsets: list[int]  # of each unit's shard in the bucket's row
    numel: int  # one rank's row: its shards of the units, end to end
    wire: torch.Tensor | None = None  # [size * numel] while its units' gradients come in

    @property
    def comm(self) -> UnitComm:
        return self.units[0].comm

    @property
    def size(self) -> int:
        """Ranks the bucket's units are sharded over."""
        return self.units[0].padded // self.units[0].shard_numel

    @property
    def alone(self) -> bool:
        """One unit: reduced from its own flat gradient, no copy."""
        return len(self.units) == 1

    def pack(self, unit: FlatUnit, full: torch.Tensor) -> None:
        """`unit`'s full gradient [padded] into the bucket's wire [size, numel] (allocated
        at the first unit; in full's dtype, the reduce dtype)."""
        if self.wire is None:
            self.wire = torch.zeros(self.size * self.numel, dtype=full.dtype,
                                    device=full.device)
        at = self.offsets[self.units.index(unit)]
        rows = self.wire.view(self.size, self.numel)  # [size, numel]
        rows[:, at:at + unit.shard_numel].copy_(full.view(self.size, unit.shard_numel))

    def take(self) -> torch.Tensor:
        """The packed wire [size * numel], handed to the reduce-scatter (the bucket lets go
        of it)."""
        wire, self.wire = self.wire, None
        return wire

    def shards(self, row: torch.Tensor) -> list[tuple[FlatUnit, torch.Tensor]]:
        """(unit, its shard [shard_numel]) of a reduced row [numel] (views of it)."""
        return [(u, row[at:at + u.shard_numel]) for u, at in zip(self.units, self.offsets)]


def make_buckets(order: list[FlatUnit], *, cap_bytes: float, element_size: int
                 ) -> list[Bucket]:
    """The units of `order` (launch order) in buckets of at most `cap_bytes` of gradient
    (`element_size` bytes per element on the wire), only units of one group together."""
    buckets = []
    for group in coalesce([u.padded * element_size for u in order], cap_bytes,
                          [u.comm for u in order]):
        units = [order[i] for i in group]
        offsets = [sum(u.shard_numel for u in units[:k]) for k in range(len(units))]
        buckets.append(Bucket(units, offsets, sum(u.shard_numel for u in units)))
    return buckets
