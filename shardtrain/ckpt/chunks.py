"""A region of a tensor (regions.py) as the boxes a distributed checkpoint stores.

DCP stores a tensor as chunks, each a box of the full tensor (per dim an offset and a
length). A rank's piece is a region: a box of the full tensor (its tensor-parallel block,
possibly running past the tensor's end where the tensor was padded) and a flat range of
that box's elements (a ZeRO shard's run). A flat range of a row-major box is a union of
at most 2 (ndim - 1) + 1 boxes whose elements are each contiguous in the range: a partial
first row, whole rows, a partial last row, recursively (`rectangles`). Clipped to the
tensor (padding is not stored), they are the piece's chunks.

Chunks are also cut on a fixed grid of a tensor's own: g tiles per dimension, g the
largest power of two up to `GRID` that leaves tiles of at least `MIN_TILE_NUMEL` elements
(each stored chunk costs ~1.6 kB of torch.save framing: a small tensor is better read
whole). A reader reads every
stored chunk that overlaps what it asks for, whole (DCP loads a stored chunk as one
object), so a chunk spanning a whole row-sharded run would make a rank that needs only a
column block (a row-parallel weight under a new tensor-parallel size) read every row of
it: on the grid a rank reads at most about one tile more than its share per edge, for
any tp size that divides the grid. Identical regions (replicas) give identical chunks,
which DCP's save planner writes once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from shardtrain.ckpt.regions import Region

GRID = 8  # tiles per dim, at most
MIN_TILE_NUMEL = 1 << 12  # 16 kB of fp32: torch.save frames each stored chunk in ~1.6 kB


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]  # in the full tensor
    sizes: tuple[int, ...]
    start: int  # the first element of its rectangle in the region's flat values
    rect: tuple[int, ...]  # the rectangle's shape: values[start:start + prod(rect)].view(rect)
    within: tuple[slice, ...]  # the chunk's part of that rectangle

    def of(self, values):
        """This chunk's values (a view) out of the region's flat values [region.numel]
        (contiguous; a tensor or a numpy array)."""
        n = math.prod(self.rect)
        return values[self.start:self.start + n].reshape(self.rect)[self.within]


def rectangles(lengths: tuple[int, ...], start: int, stop: int
               ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [start, stop) of a row-major box of `lengths` as (offsets, sizes,
    first flat index) of boxes whose elements are contiguous and in range order."""
    if start >= stop:
        return
    if len(lengths) == 1:
        yield (start,), (stop - start,), start
        return
    inner = math.prod(lengths[1:])
    first, last = start // inner, (stop - 1) // inner  # the rows touched

    def in_row(row: int, a: int, b: int):
        for off, size, s in rectangles(lengths[1:], a, b):
            yield (row, *off), (1, *size), row * inner + s

    if first == last:
        yield from in_row(first, start - first * inner, stop - first * inner)
        return
    if start % inner:  # a partial first row
        yield from in_row(first, start % inner, inner)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        yield (first,) + (0,) * (len(lengths) - 1), (whole_end - first, *lengths[1:]), \
            first * inner
    if stop % inner:  # a partial last row
        yield from in_row(whole_end, 0, stop % inner)


def _cuts(offset: int, size: int, full: int, grid: int) -> list[tuple[int, int]]:
    """[offset, offset + size) cut at multiples of the dim's grid tile: (start, length)."""
    tile = max(1, -(-full // grid))
    out, at, end = [], offset, offset + size
    while at < end:
        nxt = min(end, (at // tile + 1) * tile)
        out.append((at, nxt - at))
        at = nxt
    return out


def _grid(shape: tuple[int, ...]) -> int:
    """Tiles per dimension of the tensor's grid (module docstring)."""
    g, numel = 1, math.prod(shape)
    while g < GRID and numel // (2 * g) ** len(shape) >= MIN_TILE_NUMEL:
        g *= 2
    return g


def region_chunks(region: Region) -> list[Chunk]:
    """The region's stored chunks: its rectangles, clipped to the tensor, on the grid."""
    lengths = tuple(n for _, n in region.box)
    if not lengths:  # a scalar
        return [Chunk((), (), 0, (), ())]
    grid = _grid(region.shape)
    out = []
    for off, size, s in rectangles(lengths, region.start, region.stop):
        at = [b[0] + o for b, o in zip(region.box, off)]  # in the full tensor
        kept = [min(n, full - a) for a, n, full in zip(at, size, region.shape)]
        if any(n <= 0 for n in kept):  # wholly padding
            continue
        per_dim = [_cuts(a, n, full, grid) for a, n, full in zip(at, kept, region.shape)]
        for parts in itertools.product(*per_dim):
            within = tuple(slice(p - a, p - a + n) for (p, n), a in zip(parts, at))
            out.append(Chunk(tuple(p for p, _ in parts), tuple(n for _, n in parts),
                             s - region.start, tuple(size), within))
    return out
