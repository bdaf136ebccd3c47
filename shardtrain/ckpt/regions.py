"""Where a rank's piece of a tensor sits in the single-process tensor.

A sharded checkpoint stores each rank's tensors as they are (no gathering) and says, for
each piece, which part of the single-process tensor it is: a `Region`. A region is a box
of the full tensor (per dim: start, length; a tensor-parallel block, which may run past
the tensor's end where the tensor was padded to a multiple of the group size) and a flat
range [start, stop) of the box's elements in row-major order (a ZeRO shard covers part of
a parameter's block; a whole block is [0, box numel)). Elements of the box outside the
tensor are padding: written as they are, ignored when read.

Any layout's pieces thus describe the same tensors by the same names and coordinates,
and a checkpoint written by one layout reads into any other: `assemble` rebuilds a full
tensor from the pieces that cover it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, int], ...]  # per dim: (start, length)


@dataclass(frozen=True)
class Region:
    key: str  # "model/<name>" or "optim/<name>/<state>" (the single-process names)
    shape: tuple[int, ...]  # the full tensor's shape
    box: Box
    start: int  # flat range of the box's elements, row-major
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict:
        return {"key": self.key, "shape": list(self.shape), "box": [list(b) for b in self.box],
                "start": self.start, "stop": self.stop}

    @staticmethod
    def from_json(d: dict) -> Region:
        return Region(d["key"], tuple(d["shape"]), tuple(tuple(b) for b in d["box"]),
                      d["start"], d["stop"])


def whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def block_region(key: str, shape: tuple[int, ...], box: Box) -> Region:
    """A whole block (`box`) of the full tensor `key` of `shape`."""
    return Region(key, tuple(shape), box, 0, math.prod(n for _, n in box))


def _full_indices(region: Region, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices into the full tensor [k], which of the region's elements they are [k]):
    the region's elements that lie inside the tensor (padding left out)."""
    lengths = [n for _, n in region.box]
    idx = torch.arange(region.start, region.stop, device=device)  # [numel]
    inside = torch.ones_like(idx, dtype=torch.bool)
    full = torch.zeros_like(idx)
    rest = idx
    for d in reversed(range(len(lengths))):  # unravel in the box, offset, ravel in the tensor
        coord = rest % lengths[d] + region.box[d][0]
        rest = rest // lengths[d]
        inside &= coord < region.shape[d]
        full += coord * math.prod(region.shape[d + 1:])
    keep = inside.nonzero().flatten()
    return full[keep], keep


def place(full: torch.Tensor, region: Region, data: torch.Tensor,
          covered: torch.Tensor | None = None) -> None:
    """Write a piece's values (`data`, [region.numel]) into `full` (the whole tensor);
    mark the elements it sets in `covered` (bool, full's shape) when given."""
    if region.box == whole_box(region.shape) and region.start == 0:
        full.view(-1)[:region.stop].copy_(data)
        if covered is not None:
            covered.view(-1)[:region.stop] = True
        return
    where, which = _full_indices(region, full.device)
    full.view(-1)[where] = data.to(full.dtype)[which]
    if covered is not None:
        covered.view(-1)[where] = True

