"""A sharded checkpoint's files: each rank's pieces, the manifest, and reading them back.

Every rank writes one safetensors file (`shard-RRRRR.safetensors`: its pieces as 1-D
tensors named "0", "1", ...) and an index beside it (`shard-RRRRR.json`: each piece's
`Region`, the file's SHA-256 and size). The file is written piece by piece, straight from
the tensors the rank holds: nothing is gathered, and a piece that is not already a
contiguous CPU tensor (a GPU tensor, a slice across a padded dim, a dequantized 8-bit
moment) costs one piece-sized buffer at a time. The main rank commits the checkpoint by
merging the indexes into `manifest.json` (train/checkpoint.py renames the directory into
place after that): a directory without a manifest is not a checkpoint.

`Reader` serves any tensor of the single-process model from the pieces, whatever layout
wrote them, checking each file's checksum before its first use.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.ckpt.regions import Region, place
from shardtrain.config import ConfigError

MANIFEST = "manifest.json"
FORMAT = "shardtrain-sharded/1"
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_HASH_CHUNK = 1 << 24


@dataclass(frozen=True)
class Piece:
    region: Region
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]  # the values [region.numel], produced when written


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}"


def write_pieces(directory: Path, rank: int, pieces: Iterable[Piece],
                 extra: dict[str, Any] | None = None, aliases: dict[str, str] | None = None
                 ) -> Path:
    """Write this rank's pieces and its index into `directory`; returns the index path.
    `extra`: small JSON state kept in the manifest (rank 0's); `aliases`: names this rank
    holds that are another's tensor (a tied head: {"head.weight": "tok_emb.weight"})."""
    pieces = list(pieces)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i, p in enumerate(pieces):
        size = p.region.numel * torch.empty((), dtype=p.dtype).element_size()
        header[str(i)] = {"dtype": _DTYPES[p.dtype], "shape": [p.region.numel],
                          "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    name = shard_name(rank)
    digest = hashlib.sha256()
    with open(directory / f"{name}.safetensors", "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for p in pieces:
            data = p.fetch().detach().reshape(-1).to("cpu", p.dtype).contiguous()  # [numel]
            if data.numel() != p.region.numel:
                raise ValueError(f"piece {p.region.key} has {data.numel()} values, its region "
                                 f"{p.region.numel}")
            raw = memoryview(data.view(torch.uint8).numpy())
            f.write(raw)
            digest.update(raw)
    index = {"file": f"{name}.safetensors", "sha256": digest.hexdigest(),
             "bytes": 8 + len(head) + offset, "extra": extra or {}, "aliases": aliases or {},
             "pieces": [{**p.region.to_json(), "tensor": str(i)} for i, p in enumerate(pieces)]}
    path = directory / f"{name}.json"
    tmp = directory / f".{name}.json.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, path)  # whole or absent: the main rank may be polling for it
    return path


def wait_for_indexes(directory: Path, world_size: int, timeout_s: float) -> None:
    """Until every rank's index is in `directory` (an asynchronous save's commit)."""
    deadline = time.monotonic() + timeout_s
    missing = list(range(world_size))
    while missing:
        missing = [r for r in missing if not (directory / f"{shard_name(r)}.json").is_file()]
        if missing and time.monotonic() > deadline:
            raise TimeoutError(f"{directory}: ranks {missing} did not write their shards within "
                               f"{timeout_s:.0f} s; the checkpoint is not committed")
        time.sleep(0.05 if missing else 0)


def commit_manifest(directory: Path, world_size: int) -> None:
    """Merge every rank's index into the manifest (main rank, once all have written)."""
    files, pieces, extra, aliases = {}, [], {}, {}
    for rank in range(world_size):
        index_path = directory / f"{shard_name(rank)}.json"
        if not index_path.is_file():
            raise FileNotFoundError(
                f"{index_path}: rank {rank} wrote no shard here; every rank must write into "
                "the same train.run_dir (on several nodes: a shared filesystem)")
        index = json.loads(index_path.read_text())
        files[index["file"]] = {"sha256": index["sha256"], "bytes": index["bytes"]}
        pieces += [{**p, "file": index["file"]} for p in index["pieces"]]
        extra = extra or index["extra"]
        aliases.update(index["aliases"])
    (directory / MANIFEST).write_text(json.dumps(
        {"format": FORMAT, "world_size": world_size, "files": files, "aliases": aliases,
         "extra": extra, "pieces": pieces}))
    for rank in range(world_size):
        (directory / f"{shard_name(rank)}.json").unlink()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Reader:
    """The single-process tensors of a sharded checkpoint, one at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
            self.files: dict[str, dict] = manifest["files"]
            self.aliases: dict[str, str] = manifest["aliases"]
            self.extra: dict[str, Any] = manifest["extra"]
            self.pieces: dict[str, list[tuple[Region, str, str]]] = {}
            for p in manifest["pieces"]:
                region = Region.from_json(p)
                self.pieces.setdefault(region.key, []).append((region, p["file"], p["tensor"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}: not a readable checkpoint manifest ({e}); the "
                              "checkpoint is incomplete or corrupt: resume from another "
                              "one") from None
        self._open: dict[str, Any] = {}

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.pieces if k.startswith(prefix)]

    def has(self, key: str) -> bool:
        return self.aliases.get(key, key) in self.pieces

    def tensor(self, key: str) -> torch.Tensor:
        """The full tensor `key` (an alias reads its target), assembled from its pieces."""
        key = self.aliases.get(key, key)
        if key not in self.pieces:
            raise ConfigError(f"{self.directory / MANIFEST}: the checkpoint has no tensor "
                              f"{key!r}; it was written for another model or optimizer")
        pieces = self.pieces[key]
        first = self._file(pieces[0][1]).get_tensor(pieces[0][2])
        full = torch.empty(pieces[0][0].shape, dtype=first.dtype)
        covered = torch.zeros(full.shape, dtype=torch.bool)
        for region, file, name in pieces:
            place(full, region, self._file(file).get_tensor(name), covered)
        if not bool(covered.all()):
            missing = int((~covered).sum())
            raise ConfigError(f"{self.directory}: the pieces of {key!r} leave {missing} of its "
                              f"{math.prod(full.shape)} values unwritten; the checkpoint is "
                              "incomplete: resume from another one")
        return full

    def _file(self, name: str):
        """The opened shard file, its size and checksum checked on first use."""
        if name not in self._open:
            from safetensors import safe_open

            path = self.directory / name
            want = self.files.get(name)
            if want is None or not path.is_file():
                raise ConfigError(f"{path}: missing; the checkpoint {self.directory} is "
                                  "incomplete: resume from another one")
            if path.stat().st_size != want["bytes"] or file_sha256(path) != want["sha256"]:
                raise ConfigError(f"{path}: size or SHA-256 differs from the manifest's; the "
                                  "file is truncated or corrupt: resume from another checkpoint")
            self._open[name] = safe_open(str(path), framework="pt")
        return self._open[name]
