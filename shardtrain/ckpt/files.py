"""A checkpoint's pieces, and reading any part of any tensor back (the format: dcp.py).

A `Piece` is what a rank holds of one tensor, described as a region of the full tensor
(regions.py), with its values produced when written. `Reader` serves any region of any
tensor of the single-process model, whatever layout wrote the checkpoint, reading only the
stored chunks that overlap it; `bytes_read` counts what it read. `validate` checks a
checkpoint without reading its tensors: the metadata readable and every file it names
present and long enough.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardtrain.ckpt.chunks import region_chunks
from shardtrain.ckpt.regions import Region, whole_box
from shardtrain.config import ConfigError

METADATA = ".metadata"  # DCP's
SIDE = "shardtrain.json"  # our own: the format, tied aliases, small JSON state
CHECKSUMS = "checksums.json"  # ours: each stored chunk's and own state file's CRC-32 (dcp.py)
FORMAT = "shardtrain-dcp/1"
OLD_MANIFEST = "manifest.json"  # the format before DCP (shardtrain-sharded/1)


@dataclass(frozen=True)
class Piece:
    region: Region
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]  # the values [region.numel], produced when written


def validate(directory: Path) -> None:
    """Raise ConfigError, naming the file and the fix, unless `directory` is a whole
    checkpoint: its side file and metadata readable, every data file present and at least
    as long as the metadata says. (A corrupt byte inside a file: `verify`, and the reader's
    check of each chunk it reads.)"""
    directory = Path(directory)
    if (directory / OLD_MANIFEST).is_file() and not (directory / METADATA).is_file():
        raise ConfigError(
            f"{directory}: a checkpoint in shardtrain's earlier format ({OLD_MANIFEST}, "
            "shardtrain-sharded/1), which this version no longer reads; resume or export it "
            "with shardtrain at commit 985e675 or earlier (`shardtrain export` writes a "
            "Hugging Face directory that model.init_from reads), or start a new run")
    for name in (SIDE, METADATA, CHECKSUMS):
        if not (directory / name).is_file():
            raise ConfigError(f"{directory / name}: missing; {directory} is not a whole "
                              "checkpoint: give a step_* directory or 'latest'")
    ends: dict[str, int] = {}
    for info in _metadata(directory).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size} bytes"
            raise ConfigError(f"{path}: {found}, the checkpoint's metadata needs {end}; the "
                              "checkpoint is incomplete: resume from another one")


def verify(directory: Path, rank: int = 0, size: int = 1) -> None:
    """Read share `rank` of `size` of the checkpoint's checksummed bytes (the stored chunks,
    and the own state files: top-k's, a parameter server's) and check each against its
    CRC-32; raise ConfigError naming the first file that differs. The shares are contiguous
    runs of the files in name and offset order, of about equal bytes: together the ranks
    read the checkpoint once, each about 1/size of it, sequentially. A file whose CRC-32 was
    not recorded (an own state file of a checkpoint written before they were) is not read."""
    directory = Path(directory)
    try:
        _verify(directory, rank, size)
    except OSError as e:
        raise ConfigError(f"{e.filename or directory}: cannot be read ({e.strerror}); the "
                          "checkpoint is incomplete: resume from another one") from None
    except ValueError as e:  # checksums.json
        raise ConfigError(f"{directory / CHECKSUMS}: not readable ({e}); the checkpoint is "
                          "incomplete: resume from another one") from None


def _verify(directory: Path, rank: int, size: int) -> None:
    sums = json.loads((directory / CHECKSUMS).read_text())
    items = {(i.relative_path, i.offset, i.length, f"{i.relative_path}:{i.offset}")
             for i in _metadata(directory).storage_data.values()}
    items |= {(name, 0, (directory / name).stat().st_size, name)
              for name in sums if ":" not in name}
    total, at, mine = sum(item[2] for item in items), 0, []
    for item in sorted(items):  # an item is rank r's where its first byte falls in r's share
        if at * size // max(total, 1) == rank:
            mine.append(item)
        at += item[2]
    for name, group in itertools.groupby(mine, key=lambda item: item[0]):
        with open(directory / name, "rb") as f:
            for _, offset, length, key in group:
                f.seek(offset)
                crc, left = 0, length
                while left and (data := f.read(min(left, 16 << 20))):  # a chunk may be large
                    crc, left = zlib.crc32(data, crc), left - len(data)
                if left or sums.get(key) != f"{crc:08x}":
                    raise ConfigError(f"{directory / name}: the bytes at {offset} do not "
                                      "match their checksum; the file is corrupt: resume "
                                      "from another checkpoint")


def _metadata(directory: Path):
    path = Path(directory) / METADATA
    try:
        return FileSystemReader(directory).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise ConfigError(f"{path}: not readable checkpoint metadata ({e}); the checkpoint "
                          "is incomplete or corrupt: resume from another one") from None


class _Checked(FileSystemReader):
    """DCP's file reader, checking each stored chunk against its CRC-32 as it is read
    (computed as it was written: dcp.py `_Summed`), counting the bytes read and naming the
    file it is in."""

    def __init__(self, directory: Path, checksums: dict[str, str]):
        super().__init__(directory)
        self.checksums = checksums
        self.bytes_read, self.current = 0, ""

    def _slice_file(self, file, sinfo):
        self.current = sinfo.relative_path
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        self.bytes_read += len(data)
        want = self.checksums.get(f"{sinfo.relative_path}:{sinfo.offset}")
        if want is None or f"{zlib.crc32(data):08x}" != want:
            raise ConfigError(f"{self.path / sinfo.relative_path}: the chunk at byte "
                              f"{sinfo.offset} does not match its checksum; the file is "
                              "corrupt: resume from another checkpoint")
        return io.BytesIO(data)


class _Into(LoadPlanner):
    """A region's read plan (`items`, planned by Reader.region with DCP's resharding
    helper): the reads land in the views `dests[i]` (a read item's destination index)."""

    def __init__(self, items: list[ReadItem], dests: list[torch.Tensor]):
        self.items, self.dests = items, dests

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.dests[read_item.dest_index.index]
        for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, at, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read in place

    # DCP's load loop's other steps: one rank's plan, no global planning to do.
    def set_up_planner(self, *args, **kwargs) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: a byte item, where a shardtrain "
                         "checkpoint holds only tensors")


class Reader:
    """The single-process tensors of a checkpoint, any region of them at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        validate(self.directory)
        side = self.directory / SIDE
        try:
            meta = json.loads(side.read_text())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            self.aliases: dict[str, str] = meta["aliases"]
            self.extra: dict[str, Any] = meta["extra"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{side}: not readable ({e}); the checkpoint is incomplete or "
                              "corrupt: resume from another one") from None
        self.metadata = _metadata(self.directory)
        self.tensors = self.metadata.state_dict_metadata
        try:
            checksums = json.loads((self.directory / CHECKSUMS).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.directory / CHECKSUMS}: not readable ({e}); the "
                              "checkpoint is incomplete: resume from another one") from None
        self._files = _Checked(self.directory, checksums)
        # The values asked for (`region`), and those of the stored chunks read for them
        # (whole: bytes_read adds each chunk's ~1.6 kB of torch.save framing), in bytes.
        self.bytes_needed = self.values_read = 0
        self._volume = {(k, tuple(c.offsets)): math.prod(c.sizes) * m.properties.dtype.itemsize
                        for k, m in self.tensors.items() for c in m.chunks}
        self._files.set_up_storage_reader(self.metadata, False)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint's data files so far (whole stored chunks)."""
        return self._files.bytes_read

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.tensors if k.startswith(prefix)]

    def has(self, key: str) -> bool:
        return self.aliases.get(key, key) in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta(key).size)

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor `key` (an alias reads its target)."""
        shape = self.shape(key)
        return self.block(key, shape, whole_box(shape))

    def block(self, key: str, shape: tuple[int, ...], box) -> torch.Tensor:
        """The block `box` of tensor `key` [box lengths]; elements past the tensor's end
        (a padded tensor-parallel block) are zeros."""
        region = Region(key, tuple(shape), tuple(box), 0, math.prod(n for _, n in box))
        return self.region(key, region).view([n for _, n in box])

    def region(self, key: str, region: Region) -> torch.Tensor:
        """The region's values [region.numel] (its padding zeros), reading only the
        stored chunks that overlap it."""
        key = self.aliases.get(key, key)
        meta = self._meta(key)
        out = torch.zeros(region.numel, dtype=meta.properties.dtype)
        dests, items, wanted = [], [], 0
        for chunk in region_chunks(region):
            want = ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
            for item in create_read_items_for_chunk_list(key, meta, [want]):
                index = MetadataIndex(key, item.dest_index.offset, len(dests))
                items.append(dataclasses.replace(item, dest_index=index))
            dests.append(chunk.of(out))
            wanted += math.prod(chunk.sizes)
        self.bytes_needed += wanted * out.element_size()
        self.values_read += sum(self._volume[(key, tuple(item.storage_index.offset))]
                                for item in items)
        if sum(math.prod(item.lengths) for item in items) < wanted:
            raise ConfigError(f"{self.directory}: the stored chunks of {key!r} do not cover "
                              "what this run needs of it; the checkpoint is incomplete: "
                              "resume from another one")
        try:
            planner = _Into(items, dests)
            self._files.read_data(planner.create_local_plan(), planner).wait()
        except ConfigError:
            raise
        except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, AssertionError) as e:
            raise ConfigError(f"{self.directory / self._files.current}: cannot be read ({e}); "
                              "the file is corrupt: resume from another checkpoint") from None
        return out

    def _meta(self, key: str):
        key = self.aliases.get(key, key)
        if key not in self.tensors:
            raise ConfigError(f"{self.directory}: the checkpoint has no tensor {key!r}; it "
                              "was written for another model or optimizer")
        return self.tensors[key]
