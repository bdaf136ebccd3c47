"""Multi-token prediction (model/mtp.py) under tensor and sequence parallelism.

Each module's block is split as the main blocks are (layers.py walks them with the main
blocks); its norms are replicated as theirs are. The projection M_k [C, 2C] is a
row-parallel linear over its input features: its input, the concatenated normed hidden
state and embedding [B, S, 2C], enters a region of its own (replicated through `f`, or
gathered along the sequence under sp), rank r multiplies its slice of the 2C features by
its columns of M_k, and the partial sums leave through `g` (all-reduce, or reduce-scatter
under sp): one collective of [B, S, C] each way, and a rank holds 2C^2 / t of the weight.
Under sp the shifted tokens' embedding (whole [B, S, C] from the vocab-parallel lookup) is
cut to the rank's sequence chunk before the module, as the main embedding is before the
first block. The depths' logits come from the shared vocab-parallel head and their loss
from the vocab-parallel cross-entropy (vocab.py), like the main loss.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.parallel.tensor.layers import Region, RowParallelLinear
from shardtrain.parallel.tensor.ops import ScatterToSequence, handle
from shardtrain.parallel.tensor.sharding import Placement


class SlicedRowParallelLinear(RowParallelLinear):
    """A row-parallel linear that takes its region's whole input [B, S, in] and multiplies
    this rank's features [start, start + in/t) of it by its weight [out, in/t]."""

    def __init__(self, weight: torch.Tensor, comm: Communicator, *, sp: bool, start: int):
        super().__init__(weight, None, comm, sp=sp)
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[..., self.start:self.start + self.weight.shape[1]])


def apply_mtp_tensor_parallel(model: nn.Module, comm: Communicator, *, sp: bool
                              ) -> dict[str, Placement]:
    """Swap each module's projection for this rank's slice, in place (after layers.py's
    `apply_tensor_parallel`); returns the projections' placements."""
    places, key = {}, handle(comm)
    for k, module in enumerate(model.mtp or []):
        name, full = f"mtp.{k}.proj.weight", module.proj.weight  # [C, 2C]
        places[name] = Placement(dim=1, size=full.shape[1], parts=comm.size, index=comm.rank)
        weight = places[name].shard(full)  # [C, 2C/t]
        module.proj = SlicedRowParallelLinear(weight, comm, sp=sp,
                                              start=comm.rank * weight.shape[1])
        Region(comm, sp=sp).attach(module.proj)
        if sp:  # the embedding [B, S, C] -> this rank's chunk [B, S/t, C]
            module.register_forward_pre_hook(
                lambda m, args: (args[0], ScatterToSequence.apply(args[1], key), *args[2:]))
    return places
