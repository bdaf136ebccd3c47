"""Sharded checkpoints in PyTorch's distributed checkpoint format (DCP).

A checkpoint directory is a DCP checkpoint: `.metadata` (every tensor's full shape,
dtype and chunks, and where each chunk is stored) and one or a few `__R_j.distcp` files
per rank that wrote something, readable by `torch.distributed.checkpoint` (`dcp.load`,
`format_utils.dcp_to_torch_save`). Tensors are keyed by layout-independent names:
`model/<name>` (the single-process model's) and `optim/<name>/<state>`.

Saving (`plan_save`, `write`, `finish`): each rank lists its pieces (ckpt/files.py
`Piece`: what it holds, as regions of the full tensors) as DCP write items, one per chunk
(chunks.py). The plans of all ranks are exchanged (`gather`, given by the caller: the
mesh's collectives) and every rank computes the same global plan (saveplan.py: DCP's, on
plain tuples; once per layout, later saves exchange a digest): each chunk held by several
ranks (data-parallel replicas, shared kv heads, a pipeline's two copies of a tied
embedding) is written once, by the holder whose plan is smallest so far (DCP weighs each
chunk by its whole tensor's size, a fair proxy: a tensor's chunks are alike), so replicas
spread over their holders rather than all landing on the lowest rank; each chunk's file
and byte offset are fixed there. Each rank writes its chunks (stream.py: a bounded
staging pool, parallel fsynced files, each chunk framed as DCP's reader loads it by
frames.py, its CRC-32 computed as its bytes go out, never read back), then the CRC-32s
beside them; the main rank writes `.metadata` (planned, with every chunk's place) and the
CRC-32s into `checksums.json`, with the CRC-32 of each rank's own state files. Nothing is
gathered: values are fetched piece by piece as they are staged.

`Reader` (files.py) reads by region: it reads only the stored chunks that overlap it
(DCP's load planning), so a rank resuming in any layout reads about its own share.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from shardtrain.ckpt.chunks import Chunk
from shardtrain.ckpt.files import CHECKSUMS, METADATA, Piece
from shardtrain.ckpt.frames import as_bits
from shardtrain.ckpt.saveplan import (Layout, MetadataFile, PlanCache, collector_paused,
                                      place_of)
from shardtrain.ckpt.stream import ALIGN, Item, Staged


def results_name(rank: int) -> str:
    return f".results-{rank:05d}"


class _Pieces:
    """Where each write item's values are: its piece (found by its place in the full
    tensors, in whatever order this save lists them) and chunk (the layout's `where`);
    fetched piece by piece as the stager asks for them (one piece's values held at a time,
    where they live)."""

    def __init__(self, pieces: list[Piece], where: dict[Item, tuple[tuple, Chunk]]):
        self.pieces, self.where = {place_of(p): p for p in pieces}, where
        self._held: tuple[tuple, torch.Tensor] | None = None

    def values(self, item: Item):
        """The chunk's values [chunk sizes]: a view of its piece's, where they live; on the
        host, in the piece's dtype, as numpy integers of its size (frames.py `as_bits`)."""
        k, chunk = self.where[item]
        piece = self.pieces[k]
        if self._held is None or self._held[0] != k:
            values = piece.fetch().detach().reshape(-1)  # [numel]
            if values.numel() != piece.region.numel:
                raise ValueError(f"piece {piece.region.key} has {values.numel()} values, its "
                                 f"region {piece.region.numel}")
            if values.is_cpu and values.dtype == piece.dtype:
                values = as_bits(values)
            self._held = (k, values)
        values = chunk.of(self._held[1])
        if isinstance(values, np.generic):  # numpy's element of a 0-d array
            values = np.asarray(values)
        if isinstance(values, torch.Tensor) and values.dtype != piece.dtype:
            values = values.to(piece.dtype)  # a chunk-sized copy
        return values


class SavePlanned:
    """One rank's part of a save, planned: what it writes, where, and (the main rank's) the
    checkpoint's metadata."""

    def __init__(self, directory: Path, rank: int, pieces: list[Piece], layout: Layout,
                 device: torch.device | None = None, staging_bytes: int | None = None):
        self.directory, self.rank = Path(directory), rank
        self.pieces, self.layout = _Pieces(pieces, layout.where), layout
        self.metadata: MetadataFile | None = layout.metadata  # `finish`'s, on the main rank
        self.device = device  # where the pieces' values live (None: the host)
        self.staging_bytes = staging_bytes  # the staging pool's (None: the whole share)
        self.items = [item for _, run in layout.files for item in run]
        self._staged: Staged | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes: its chunks' values, each framed (frames.py)."""
        return sum(item.stored for item in self.items)

    @property
    def staged_peak(self) -> int:
        """The most bytes this save held staged at once (none yet: 0)."""
        return self._staged.pool.peak if self._staged is not None else 0

    def start(self) -> None:
        """Stage every chunk this rank writes (stream.py: through a pool of at most
        `staging_bytes`, pinned on a GPU), the writer threads writing as it goes; returns
        once all are staged: the live tensors may change after it, for an asynchronous
        save. `write` waits for the files."""
        # The whole share, each chunk at its aligned place in a buffer (stream.py ALIGN).
        values = sum(-(-item.nbytes // ALIGN) * ALIGN for item in self.items)
        budget = values if self.staging_bytes is None else min(self.staging_bytes, values)
        # Pinned where the values come from a GPU: their copies then run asynchronously.
        pinned = self.device is not None and self.device.type == "cuda" \
            and torch.cuda.is_available()
        self._staged = Staged(self.directory, self.layout.files, budget, pinned)
        try:
            with collector_paused():
                self._staged.start(self.pieces.values)
        finally:
            self.pieces._held = None

    def write(self, own_sums: dict[str, str] | None = None) -> None:
        """Write this rank's files (fsynced; staged first unless `start` did) and, last,
        the CRC-32s of its chunks with `own_sums` (the CRC-32 of each of this rank's own
        state files, train/checkpoint/checkpoint.py `stage_files`) for the main rank's
        `finish`: not fsynced, as `finish` reads them before the commit and removes them;
        the commit's fsyncs make what it took from them durable."""
        if self._staged is None:
            self.start()
        sums = self._staged.wait()
        write_file(self.directory / results_name(self.rank),
                   json.dumps({**sums, **(own_sums or {})}).encode(), sync=False)


def plan_save(directory: Path, rank: int, pieces: list[Piece],
              gather: Callable[[object], list], device: torch.device | None = None,
              staging_bytes: int | None = None, cache: PlanCache | None = None
              ) -> SavePlanned:
    """Plan this rank's part of the save (a collective: `gather` returns every rank's
    object, in rank order); `device`: where the pieces' values live (None: the host);
    `staging_bytes`: the staging pool's bytes (`checkpoint.staging_mb`; None: the rank's
    whole share); `cache`: the plan of earlier saves (saveplan.py; None: plan afresh)."""
    layout = (cache or PlanCache()).plan(rank, pieces, gather)
    return SavePlanned(directory, rank, pieces, layout, device, staging_bytes)


def finish(directory: Path, metadata: MetadataFile, world_size: int,
           side: dict[str, bytes] | None = None) -> None:
    """On the main rank once every rank has written: `.metadata`, `checksums.json` (the
    CRC-32s each rank wrote, merged; their files removed) and the `side` files ({name:
    bytes}), each fsynced, from threads."""
    checksums = {}
    for rank in range(world_size):
        path = Path(directory) / results_name(rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: rank {rank} wrote no results here; every rank must write into the "
                "same train.run_dir (on several nodes: a shared filesystem)")
        checksums.update(json.loads(path.read_bytes()))
    write_files(Path(directory), {CHECKSUMS: json.dumps(checksums).encode(),
                                  METADATA: metadata.for_save(), **(side or {})})
    for rank in range(world_size):
        (Path(directory) / results_name(rank)).unlink()


def write_file(path: Path, data: bytes, sync: bool = True) -> None:
    """Write `data` whole under `path`, fsynced unless `sync` is False (atomically: via a
    temporary name)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write each of `files` ({name: bytes}) fsynced into `directory`, each from its own
    thread: their fsyncs wait on the disk together, not one after another."""
    in_threads([partial(write_file, directory / name, data) for name, data in files.items()])


def in_threads(calls: list[Callable[[], object]]) -> list:
    """Each call's result, each call run in its own thread; the first error raised here,
    once all have ended."""
    out: list = [None] * len(calls)
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            out[k] = calls[k]()
        except BaseException as e:  # raised below, on the caller's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(k,), name=f"checkpoint-{k}")
               for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def fsync_dir(path: Path) -> None:
    """Make `path`'s entries (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
