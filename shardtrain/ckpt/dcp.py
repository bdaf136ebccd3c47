"""Sharded checkpoints in PyTorch's distributed checkpoint format (DCP).

A checkpoint directory is a DCP checkpoint: `.metadata` (every tensor's full shape,
dtype and chunks, and where each chunk is stored) and one or a few `__R_j.distcp` files
per rank that wrote something, readable by `torch.distributed.checkpoint` (`dcp.load`,
`format_utils.dcp_to_torch_save`). Tensors are keyed by layout-independent names:
`model/<name>` (the single-process model's) and `optim/<name>/<state>`.

Saving (`plan_save`, `write`, `finish`): each rank lists its pieces (ckpt/files.py
`Piece`: what it holds, as regions of the full tensors) as DCP write items, one per chunk
(chunks.py). The plans of all ranks are exchanged (`gather`, given by the caller: the
mesh's collectives) and every rank computes the same global plan: DCP's
`dedup_save_plans` keeps one copy of each chunk held by several ranks (data-parallel
replicas, shared kv heads, a pipeline's two copies of a tied embedding) and gives it to
the holder whose plan is smallest so far (DCP weighs each chunk by its whole tensor's
size, a fair proxy: a tensor's chunks are alike), so replicas spread over their holders
rather than all landing on the lowest rank. Each rank writes its chunks (stream.py: a
bounded staging pool, parallel fsynced files, each chunk framed as DCP's reader loads it
by frames.py, its CRC-32 computed as its bytes go out, never read back), then its write
results beside them; the main rank merges those into `.metadata` with DCP's writer
(`finish`) and the CRC-32s into `checksums.json`, with the CRC-32 of each rank's own
state files. Nothing is gathered: values are fetched piece by piece as they are staged.

`Reader` (files.py) reads by region: it reads only the stored chunks that overlap it
(DCP's load planning), so a rank resuming in any layout reads about its own share.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from shardtrain.ckpt.chunks import Chunk, region_chunks
from shardtrain.ckpt.files import CHECKSUMS, Piece
from shardtrain.ckpt.frames import as_bits
from shardtrain.ckpt.stream import Item, Staged, split

ITEM_FRAME_BYTES = 2048  # the archive around one chunk's values (~1.6 kB: frames.py)


def results_name(rank: int) -> str:
    return f".results-{rank:05d}"


class _Pieces:
    """Where each write item's values are: its piece and chunk; fetched piece by piece as
    the stager asks for them (one piece's values held at a time, where they live)."""

    def __init__(self, pieces: list[Piece]):
        self.pieces = pieces
        self.where: dict[MetadataIndex, tuple[int, Chunk]] = {}
        self.plain: list[tuple] = []  # the items as plain tuples (they travel: `plan_save`)
        for k, piece in enumerate(pieces):
            dtype = str(piece.dtype).removeprefix("torch.")
            for chunk in region_chunks(piece.region):
                self.where[MetadataIndex(piece.region.key, torch.Size(chunk.offsets))] = (k, chunk)
                self.plain.append((piece.region.key, chunk.offsets, chunk.sizes,
                                   piece.region.shape, dtype))
        self._held: tuple[int, torch.Tensor] | None = None

    def values(self, item: Item):
        """The chunk's values [chunk sizes]: a view of its piece's, where they live; on the
        host, in the piece's dtype, as numpy integers of its size (frames.py `as_bits`)."""
        k, chunk = self.where[item.index]
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
    """One rank's part of a save, planned: what it writes, and the checkpoint's metadata
    (the same on every rank)."""

    def __init__(self, directory: Path, rank: int, pieces: _Pieces, plan: SavePlan,
                 metadata: Metadata, device: torch.device | None = None,
                 staging_bytes: int | None = None):
        self.directory, self.rank = Path(directory), rank
        self.pieces, self.plan, self.metadata = pieces, plan, metadata
        self.device = device  # where the pieces' values live (None: the host)
        self.staging_bytes = staging_bytes  # the staging pool's (None: the whole share)
        self.items = [Item(i.index, i.tensor_data.properties.dtype,
                           tuple(i.tensor_data.chunk.sizes),
                           math.prod(i.tensor_data.chunk.sizes)
                           * i.tensor_data.properties.dtype.itemsize) for i in plan.items]
        self._staged: Staged | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes: its chunks' values, each framed (frames.py)."""
        return sum(item.nbytes + ITEM_FRAME_BYTES for item in self.items)

    @property
    def staged_peak(self) -> int:
        """The most bytes this save held staged at once (none yet: 0)."""
        return self._staged.pool.peak if self._staged is not None else 0

    def start(self) -> None:
        """Stage every chunk this rank writes (stream.py: through a pool of at most
        `staging_bytes`, pinned on a GPU), the writer threads writing as it goes; returns
        once all are staged: the live tensors may change after it, for an asynchronous
        save. `write` waits for the files."""
        values = sum(item.nbytes for item in self.items)
        budget = values if self.staging_bytes is None else min(self.staging_bytes, values)
        # Pinned where the values come from a GPU: their copies then run asynchronously.
        pinned = self.device is not None and self.device.type == "cuda" \
            and torch.cuda.is_available()
        prefix = self.plan.storage_data.prefix  # DCP's `__<rank>_`
        self._staged = Staged(self.directory, prefix, split(self.items, values), budget,
                              pinned)
        try:
            self._staged.start(self.pieces.values)
        finally:
            self.pieces._held = None

    def write(self, own_sums: dict[str, str] | None = None) -> None:
        """Write this rank's files (fsynced; staged first unless `start` did) and, last,
        its write results: the chunks' storage and CRC-32s, with `own_sums` (the CRC-32 of
        each of this rank's own state files, train/checkpoint/checkpoint.py
        `stage_files`)."""
        if self._staged is None:
            self.start()
        results, sums = self._staged.wait()
        write_synced(self.directory / results_name(self.rank),
                     pickle.dumps((results, {**sums, **(own_sums or {})})))


def plan_save(directory: Path, rank: int, pieces: list[Piece],
              gather: Callable[[list[tuple]], list[list[tuple]]],
              device: torch.device | None = None,
              staging_bytes: int | None = None) -> SavePlanned:
    """Plan this rank's part of the save (a collective: `gather` returns every rank's
    plain items, in rank order); `device`: where the pieces' values live (None: the host);
    `staging_bytes`: the staging pool's bytes (`checkpoint.staging_mb`; None: the rank's
    whole share)."""
    where = _Pieces(pieces)
    plans = [_plan(items) for items in gather(where.plain)]
    _check_duplicates(plans)
    plans = dedup_save_plans(plans)  # each shared chunk to the least loaded of its holders
    plans, metadata = create_default_global_save_plan(plans)
    plans = _writer(directory, rank).prepare_global_plan(plans)
    return SavePlanned(directory, rank, where, plans[rank], metadata, device, staging_bytes)


def _plan(plain: list[tuple]) -> SavePlan:
    """Write items from (name, chunk offsets, chunk sizes, tensor shape, dtype name)."""
    return SavePlan([WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape)))
        for key, offsets, sizes, shape, dtype in plain])


def finish(directory: Path, metadata: Metadata, world_size: int) -> None:
    """On the main rank once every rank has written: merge the write results into
    `.metadata` (fsynced; the results files removed)."""
    results, checksums = [], {}
    for rank in range(world_size):
        path = Path(directory) / results_name(rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: rank {rank} wrote no results here; every rank must write into the "
                "same train.run_dir (on several nodes: a shared filesystem)")
        written, sums = pickle.loads(path.read_bytes())
        results.append(written)
        checksums.update(sums)
    write_synced(Path(directory) / CHECKSUMS, json.dumps(checksums).encode())
    _writer(directory, 0).finish(metadata, results)
    for rank in range(world_size):
        (Path(directory) / results_name(rank)).unlink()


def _writer(directory: Path, rank: int) -> FileSystemWriter:
    """DCP's writer: its global plan (each rank's file prefix) and metadata (`finish`)."""
    writer = FileSystemWriter(directory, sync_files=True, overwrite=True)
    writer.set_up_storage_writer(rank == 0, rank=rank)
    return writer


def _check_duplicates(plans: list[SavePlan]) -> None:
    """DCP deduplicates chunks by (name, offsets): two ranks' chunks there must be the same
    chunk, or one would be dropped."""
    seen: dict[MetadataIndex, torch.Size] = {}
    for plan in plans:
        for item in plan.items:
            sizes = item.tensor_data.chunk.sizes
            if seen.setdefault(item.index, sizes) != sizes:
                raise RuntimeError(f"{item.index.fqn}: two ranks hold different chunks at "
                                   f"offsets {tuple(item.index.offset)} ({tuple(sizes)} and "
                                   f"{tuple(seen[item.index])}); their regions must match")


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` whole, fsynced, under `path` (atomically: via a temporary name)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
