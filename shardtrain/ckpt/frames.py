"""A stored chunk's bytes as DCP's reader loads them, without a `torch.save` per chunk.

DCP's file reader loads each stored chunk with `torch.load` (a zip archive: a pickle
naming the storage, the raw values, a few small records and the directory). Everything
in that archive except the values depends on the chunk's dtype and shape alone, once the
archive's per-record CRC-32s are left out (`torch.utils.serialization.config`
`save.compute_crc32 = False`: torch writes zeros there, and its reader skips the check;
our own CRC-32 of each stored chunk, in checksums.json, covers every byte). So one
`torch.save` per (dtype, shape) gives a frame, `header` and `trailer`, and every chunk of
that dtype and shape is `header + raw values + trailer`: byte for byte the archive
`torch.save` would write, but the values go from memory to the file with no copy through
the zip writer (a `torch.save` costs ~0.1 ms even for 16 kB; the default model has
~1,200 chunks).

The values' place in the archive is found by saving two fillings whose every byte
differs (`a` and `a ^ 0xff`): the bytes that differ are exactly the values.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.serialization import config as serialization_config


@dataclass(frozen=True)
class Frame:
    header: bytes  # the archive up to the values
    trailer: bytes  # the archive after them

    @property
    def nbytes(self) -> int:
        return len(self.header) + len(self.trailer)


@functools.lru_cache(maxsize=4096)
def frame(dtype: torch.dtype, shape: tuple[int, ...]) -> Frame:
    """The archive around the raw values of a tensor of `dtype` and `shape`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        raise ValueError(f"an empty chunk {shape} has no values to frame")
    if nbytes >= LARGE:
        found = _frame_of_large(dtype, shape, nbytes)
        if found is not None:
            return found
    fill = np.resize(np.arange(251, dtype=np.uint8), nbytes)  # [nbytes]
    a, b = (_saved(torch.from_numpy(f).view(dtype).reshape(shape)) for f in (fill, ~fill))
    if len(a) != len(b):
        raise RuntimeError("torch.save's archive depends on the values; this torch cannot "
                           "frame raw chunks")
    differ = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    first, last = int(differ[0]), int(differ[-1])
    if last - first + 1 != nbytes:
        raise RuntimeError(f"torch.save's archive of {dtype} {shape} holds its "
                           f"{nbytes} bytes of values {last - first + 1} bytes apart")
    return Frame(a[:first], a[last + 1:])


LARGE = 1 << 20  # a chunk's bytes from which its frame is found without copies of it


class _Sink:
    """torch.save's file: keeps every write but the values' (one write of `nbytes`)."""

    def __init__(self, nbytes: int):
        self.nbytes, self.at, self.kept, self.values_at = nbytes, 0, [], []

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if n == self.nbytes:
            self.values_at.append(self.at)
        else:
            self.kept.append((self.at, bytes(b)))
        self.at += n
        return n

    def flush(self) -> None:
        pass


def _frame_of_large(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> Frame | None:
    """The frame of a large chunk from a save of zeros (calloc'd: untouched pages take no
    memory) into a sink that drops the values: no copy of the chunk's size is made. None
    where torch did not write the values in one piece (then: the two fillings)."""
    zeros = torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).reshape(shape)
    sink = _Sink(nbytes)
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(zeros, sink)
    if len(sink.values_at) != 1:
        return None
    at = sink.values_at[0]
    return Frame(b"".join(b for o, b in sink.kept if o < at),
                 b"".join(b for o, b in sink.kept if o > at))


def _saved(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(t, out)
    return out.getvalue()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The values of a contiguous host tensor as bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a numpy array of integers of the same size (a view: the
    same bytes, for any dtype, bfloat16 included). Staging slices and copies chunks in
    numpy: ~1 us an operation against torch's ~5-10, and a model has ~1,000s of chunks."""
    return t.view(_INTS[t.dtype.itemsize]).numpy()


def parts(t, limit: int):
    """`t` (any view: a tensor or a numpy array) cut into views of at most `limit`
    elements (one element at least), in row-major order: whole rows where they fit, a
    too-long row cut itself."""
    if math.prod(t.shape) <= limit:
        yield t
    elif len(t.shape) <= 1:
        flat = t.reshape(-1)  # a 1-D view
        for at in range(0, flat.shape[0], limit):
            yield flat[at:at + limit]
    else:
        row = math.prod(t.shape[1:])
        rows = max(1, limit // row)
        for at in range(0, t.shape[0], rows):
            if row > limit:
                yield from parts(t[at], limit)
            else:
                yield t[at:at + rows]
