"""Where a rank's piece of a tensor sits in the single-process tensor.

A sharded checkpoint stores each rank's tensors as they are (no gathering) and says, for
each piece, which part of the single-process tensor it is: a `Region`. A region is a box
of the full tensor (per dim: start, length; a tensor-parallel block, which may run past
the tensor's end where the tensor was padded to a multiple of the group size) and a flat
range [start, stop) of the box's elements in row-major order (a ZeRO shard covers part of
a parameter's block; a whole block is [0, box numel)). Elements of the box outside the
tensor are padding: written as they are, ignored when read.

Any layout's pieces thus describe the same tensors by the same names and coordinates,
and a checkpoint written by one layout reads into any other (chunks.py: a region as the
boxes a distributed checkpoint stores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def block_region(key: str, shape: tuple[int, ...], box: Box) -> Region:
    """A whole block (`box`) of the full tensor `key` of `shape`."""
    return Region(key, tuple(shape), box, 0, math.prod(n for _, n in box))
