"""ZeRO-3 by broadcast: the layer partition (`parallel.zero_partition = layer`).

Seed 001's inter-layer partitioning: instead of cutting every unit into N_d equal slices
(units.py, the flat partition), each dp rank owns whole units, dealt out largest first to
the rank holding the fewest elements so far (cost/units.py `layer_owners`). The owner keeps
the unit's fp32 parameters, gradient and optimizer state; the other ranks hold an empty
shard of it. A unit's parameters travel from their owner when they are needed -- a
broadcast before its forward and again before its backward, where the flat partition
all-gathers -- and its gradient is reduced to the owner (a reduce, not a reduce-scatter),
which alone steps it. The gatherer, reducer and optimizer are the flat partition's
(gather.py, reducer.py, optim.py): a unit's `LayerComm` is the only difference.

Per micro-batch and unit of S bytes (N = N_d): the owner sends 2 (N - 1) S (two broadcasts)
and every other rank S (its gradient); the flat partition sends 3 (N - 1) / N S from every
rank. Memory: a rank holds the whole state of its units, so the busiest rank holds the
largest share the greedy deal leaves it -- at least one whole unit, where the flat
partition holds 1/N of each. plan/layer_partition.py prices both.
"""

from __future__ import annotations

import torch

from shardtrain.comm import Communicator, Handle
from shardtrain.parallel.zero.units import FlatUnit, UnitComm, on_wire


class _Then:
    """A handle whose wait also runs `after` (the owner's copy out of a reduce)."""

    def __init__(self, handle: Handle, after):
        self.handle, self.after, self.done = handle, after, False

    def wait(self) -> None:
        self.handle.wait()
        if not self.done:
            self.done = True
            self.after()


class LayerComm(UnitComm):
    """The collectives of one unit owned whole by group rank `owner` (one per unit, so the
    reducer's buckets, which join units of the same comm, keep each unit alone)."""

    def __init__(self, comm: Communicator, *, owner: int):
        super().__init__(comm)
        self.owner = owner
        self.mine = comm.rank == owner

    def gather_params(self, unit: FlatUnit, full: torch.Tensor, shard: torch.Tensor, *,
                      phase: str, async_op: bool = True) -> Handle:
        """full [padded] <- the owner's shard [padded] (in full's dtype), by broadcast."""
        if self.mine:
            full.copy_(on_wire(shard, full))
        return self.comm.broadcast(full, self.owner, async_op=async_op, tag="param")

    def reduce_grads(self, shard: torch.Tensor, full: torch.Tensor, *,
                     async_op: bool = True) -> Handle:
        """The owner's shard [padded] <- the dp average of full [padded]; the others' shard
        is empty and their full is scratch."""
        handle = self.comm.reduce(full, self.owner, "avg", async_op=async_op, tag="grad")
        return _Then(handle, (lambda: shard.copy_(full)) if self.mine else (lambda: None))

    def gather_state(self, unit: FlatUnit, full: torch.Tensor, master: torch.Tensor) -> None:
        if self.mine:
            full.copy_(master)
        self.comm.broadcast(full, self.owner, tag="state")


def layer_comms(units: list[FlatUnit], comm: Communicator) -> LayerComm:
    """Give each unit (built with `partition="layer"`) the LayerComm of its owner; returns
    one of them (the model's `unit_comm`: the group, for the gradient norm)."""
    for u in units:
        u.comm = LayerComm(comm, owner=u.owner)
    return units[0].comm
