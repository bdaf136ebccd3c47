"""A rank's state as a plain dict, for a rejoining group to receive from a live peer with
its coordinates (CrossReplica.attach; torchft sends it), and read back through the same
path a checkpoint is read by (`Strategy.load_state`), so it holds exactly what a checkpoint
would: the layout's pieces (parameters, optimizer state, DiLoCo's outer state) and the
small state beside them. Sender and receiver have the same layout, so every region asked
for is one that was sent."""

from __future__ import annotations

import math
from typing import Any

import torch

from shardtrain.ckpt.regions import Region, whole_box
from shardtrain.parallel.pieces import module_pieces


def pieces_state(strategy: Any) -> dict[str, Any]:
    """`strategy`: parallel/strategy.py's; its pieces' values, copied now."""
    pieces, extra = strategy.state_pieces()
    # ZeRO-1/2 read every parameter whole (zero/model.py load_state), which a checkpoint
    # has from all the group's ranks and one rank's pieces do not (its master shard only):
    # the rank's whole local blocks travel too, where they are not already a piece.
    sent = {p.region for p in pieces}
    pieces += [p for p in module_pieces(strategy.shards) if p.region not in sent
               and p.fetch().numel() == p.region.stop - p.region.start]
    return {"regions": [(p.region.key, p.region.shape, p.region.box, p.region.start,
                         p.region.stop) for p in pieces],
            "values": [p.fetch().detach().to(p.dtype, copy=True).reshape(-1) for p in pieces],
            "extra": extra}


class PiecesReader:
    """The part of ckpt/files.py's Reader that `Strategy.load_state` uses, over a
    `pieces_state` dict."""

    def __init__(self, state: dict[str, Any]):
        self.extra = state["extra"]
        self._values = {(k, tuple(s), _box(b), a, z): v for (k, s, b, a, z), v in
                        zip(state["regions"], state["values"])}
        self._shapes = {k[0]: k[1] for k in self._values}

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self._shapes if k.startswith(prefix)]

    def has(self, key: str) -> bool:
        return key in self._shapes

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def tensor(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        return self.block(key, shape, whole_box(shape))

    def block(self, key: str, shape: tuple[int, ...], box) -> torch.Tensor:
        region = Region(key, tuple(shape), tuple(box), 0, math.prod(n for _, n in box))
        return self.region(key, region).view([n for _, n in box])

    def region(self, key: str, region: Region) -> torch.Tensor:
        at = (key, tuple(region.shape), _box(region.box), region.start, region.stop)
        if at not in self._values:
            raise ValueError(f"the peer's state has no region {at} of {key!r}: the rejoining "
                             "group's layout differs from the quorum's")
        return self._values[at]


def _box(box) -> tuple:
    return tuple(tuple(b) for b in box)
