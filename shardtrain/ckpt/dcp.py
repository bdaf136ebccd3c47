"""Sharded checkpoints in PyTorch's distributed checkpoint format (DCP).

A checkpoint directory is a DCP checkpoint: `.metadata` (every tensor's full shape,
dtype and chunks, and where each chunk is stored) and one `__R_0.distcp` file per rank
that wrote something, readable by `torch.distributed.checkpoint` (`dcp.load`,
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
rather than all landing on the lowest rank. Each rank writes its files through DCP's
`FileSystemWriter` (fsynced), then its write results beside them; the main rank merges
those into `.metadata` (`finish`). Nothing is gathered: values are fetched piece by piece
as they are written.

Each stored chunk's CRC-32 is computed as its bytes go to the file (`_Summed`: the stream
DCP's writer hands each chunk to), never by reading the files back; the main rank merges
them into `checksums.json`, with the CRC-32 of each rank's own state files (`finish`).

`Reader` (files.py) reads by region: it reads only the stored chunks that overlap it (DCP's load planning), so a rank resuming in any layout reads about its own
share.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)

from shardtrain.ckpt.chunks import Chunk, region_chunks
from shardtrain.ckpt.files import CHECKSUMS, Piece

ITEM_FRAME_BYTES = 2048  # torch.save's archive around one chunk (~1.6 kB measured)


def results_name(rank: int) -> str:
    return f".results-{rank:05d}"


class _PiecesPlanner(SavePlanner):
    """The values of this rank's write items, fetched piece by piece as DCP's writer asks
    for them (one piece's values held at a time, where they live)."""

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

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        """The chunk's values [chunk sizes], cut on the piece's own device (DCP's writer
        copies them to the host, ahead of the write on a GPU, in an order of its own)."""
        k, chunk = self.where[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        piece = self.pieces[k]
        if self._held is None or self._held[0] != k:
            values = piece.fetch().detach().reshape(-1)  # [numel]
            if values.numel() != piece.region.numel:
                raise ValueError(f"piece {piece.region.key} has {values.numel()} values, its "
                                 f"region {piece.region.numel}")
            self._held = (k, values)
        return chunk.of(self._held[1]).to(piece.dtype).contiguous()

    # The planning steps run in `plan_save`, outside DCP's own save loop.
    def set_up_planner(self, *args, **kwargs) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return _plan(self.plain)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan


class SavePlanned:
    """One rank's part of a save, planned: what it writes, and the checkpoint's metadata
    (the same on every rank)."""

    def __init__(self, directory: Path, rank: int, planner: _PiecesPlanner, plan: SavePlan,
                 metadata: Metadata, device: torch.device | None = None):
        self.directory, self.rank = Path(directory), rank
        self.planner, self.plan, self.metadata = planner, plan, metadata
        self.device = device  # where the pieces' values live (None: the host)
        self.copied: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes: its chunks' values, each framed by torch.save."""
        return sum(math.prod(item.tensor_data.chunk.sizes)
                   * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
                   + ITEM_FRAME_BYTES for item in self.plan.items)

    def snapshot(self) -> None:
        """Copy the values this rank writes into host memory now, for an asynchronous save
        (the step loop goes on changing the live tensors): pinned buffers filled without
        blocking where the values are on a GPU; `write` waits for the copies."""
        used = {self.planner.where[MetadataIndex(item.index.fqn, item.index.offset)][0]
                for item in self.plan.items}
        cuda = None  # the device the copies were queued on, if any
        for k in sorted(used):
            piece = self.planner.pieces[k]
            values = piece.fetch().detach().reshape(-1)  # [numel]
            host = torch.empty(values.numel(), dtype=piece.dtype, pin_memory=values.is_cuda)
            host.copy_(values, non_blocking=values.is_cuda)
            cuda = values.device if values.is_cuda else cuda
            self.planner.pieces[k] = dataclasses.replace(piece, fetch=lambda host=host: host)
        # Only copies queued on a GPU need an event (a CPU save touches no GPU), recorded
        # on their device's stream: the writer thread waits on it.
        if cuda is not None:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(cuda))

    def write(self, own_sums: dict[str, str] | None = None) -> None:
        """Write this rank's files (fsynced) and, last, its write results: the chunks'
        storage and CRC-32s, with `own_sums` (the CRC-32 of each of this rank's own state
        files, train/checkpoint/checkpoint.py `stage_files`)."""
        if self.copied is not None:
            self.copied.synchronize()
        # DCP's own loader, wherever a GPU exists, copies values ahead on the current CUDA
        # stream; host values (a CPU run, a snapshot) take its serial one, which uses none.
        on_gpu = self.device is not None and self.device.type == "cuda" and self.copied is None
        writer = _writer(self.directory, self.rank, copy_ahead=on_gpu)
        writer.transforms = summed = _Summed()
        results = writer.write_data(self.plan, self.planner).value()
        self.planner._held = None
        sums = {_key(r.storage_data): summed.sums[_key(r.storage_data)] for r in results
                if _key(r.storage_data) in summed.sums}
        if len(sums) < len(results):  # a torch whose writer no longer streams each item
            sums.update(_read_back(self.directory, results))  # through `transforms`
        write_synced(self.directory / results_name(self.rank),
                     pickle.dumps((results, {**sums, **(own_sums or {})})))


def plan_save(directory: Path, rank: int, pieces: list[Piece],
              gather: Callable[[list[tuple]], list[list[tuple]]],
              device: torch.device | None = None) -> SavePlanned:
    """Plan this rank's part of the save (a collective: `gather` returns every rank's
    plain items, in rank order); `device`: where the pieces' values live (None: the host)."""
    planner = _PiecesPlanner(pieces)
    plans = [_plan(items) for items in gather(planner.plain)]
    _check_duplicates(plans)
    plans = dedup_save_plans(plans)  # each shared chunk to the least loaded of its holders
    plans, metadata = create_default_global_save_plan(plans)
    plans = _writer(directory, rank).prepare_global_plan(plans)
    return SavePlanned(directory, rank, planner, plans[rank], metadata, device)


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


def _key(info) -> str:
    """A stored chunk's name in checksums.json: "file:offset"."""
    return f"{info.relative_path}:{info.offset}"


class _CrcStream(io.RawIOBase):
    """The stream one chunk is written through: its bytes go on to the file, their CRC-32
    is kept under the chunk's key when DCP's writer closes it (which leaves the file open,
    as torch's own per-item wrapper does)."""

    def __init__(self, raw, sums: dict[str, str]):
        self.raw, self.sums, self.crc = raw, sums, 0
        self.key = f"{os.path.basename(raw.name)}:{raw.tell()}"

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.raw.write(b)

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
            self.sums[self.key] = f"{self.crc:08x}"
        super().close()


class _Summed(_StorageWriterTransforms):
    """DCP's per-item stream transforms (an experimental hook of its FileSystemWriter):
    none that changes a byte or is recorded in the metadata (plain DCP files, as
    `dcp.load` reads them), only the CRC-32 of each chunk as it is written."""

    def __init__(self):
        super().__init__(())
        self.sums: dict[str, str] = {}

    def transform_save_stream(self, write_item, raw_stream):
        return _CrcStream(raw_stream, self.sums), []


def _read_back(directory: Path, results: list) -> dict[str, str]:
    """CRC-32s read back from the files just written: the fallback of `SavePlanned.write`
    if torch's writer ever stops streaming chunks through `_Summed` (not taken on the
    torch this was written for: tests/test_checkpoint.py checks)."""
    out = {}
    for result in results:
        info = result.storage_data
        with open(Path(directory) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[_key(info)] = f"{zlib.crc32(f.read(info.length)):08x}"
    return out


def _writer(directory: Path, rank: int, copy_ahead: bool = False) -> FileSystemWriter:
    """`copy_ahead`: DCP's default loader (values on a GPU); else its serial one."""
    serial = {} if copy_ahead else {"per_thread_copy_ahead": 0}
    writer = FileSystemWriter(directory, sync_files=True, overwrite=True, **serial)
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
