"""A save's global plan, computed once per layout and reused (ckpt/dcp.py `plan_save`).

Planning a save is per-chunk Python: the rank's regions cut into chunks (chunks.py), the
plans exchanged, the chunks several ranks hold given to one of them, each chunk's place in
the files, DCP's `.metadata` built and pickled. At dim 1024 that is ~11,000 chunks and
seconds of work; the bytes to write take about as long. It depends only on what every rank
holds (each piece's region and dtype), which a run changes only with its layout, so
`PlanCache` keeps the result and a later save exchanges 32 bytes per rank instead: a
16-byte digest of the rank's regions and the digest of the global plan it holds. Every
rank reuses its plan when every rank holds the plan of exactly the current digests (each
decides from the same gathered bytes, so all decide alike); otherwise all plan afresh.

The global plan is DCP's, computed on plain tuples (DCP's `dedup_save_plans` and
`create_default_global_save_plan` build a dataclass per chunk and per rank, ~1 s at 11,000
chunks; `tests/test_checkpoint_plan.py` checks ours equal to theirs): each chunk several
ranks hold goes to the holder whose plan is smallest so far, weighed as DCP weighs it (its
whole tensor's bytes), ties as DCP breaks them (the first of the holders' set); each
tensor's chunks are listed in rank order, a chunk's index hint its place in that list.
Each rank's chunks then get their data file and byte offset (stream.py `place`: a framed
chunk's length depends only on its dtype and shape, frames.py), so writing is pure byte
streaming and the write results are known before a byte is written. The main rank builds
the metadata with every rank's offsets and pickles it in a thread while the ranks write;
each save's `.metadata` differs only by DCP's save id (`MetadataFile`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import pickle
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import (CURRENT_DCP_VERSION, DEFAULT_SUFFIX,
                                                     _StorageInfo)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from shardtrain.ckpt.chunks import Chunk, region_chunks
from shardtrain.ckpt.files import Piece
from shardtrain.ckpt.stream import Item, place

# One stored chunk as it travels: (tensor key, chunk offsets, chunk sizes, tensor shape,
# dtype name).
Plain = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def dedup(plans: list[list[Plain]]) -> list[list[int]]:
    """Each rank's chunks kept (positions in its plan, in order): every chunk once, at the
    holder DCP's `dedup_save_plans` picks (module docstring)."""
    holders: dict[tuple, set[int]] = {}
    weight: dict[tuple, int] = {}
    for r, plan in enumerate(plans):
        for key, offsets, sizes, shape, dtype in plan:
            holders.setdefault((key, offsets), set()).add(r)
            weight[(key, offsets)] = math.prod(shape) * _itemsize(dtype) or 1
    size, owner = [0] * len(plans), {}
    for index, ranks in holders.items():
        pick = owner[index] = min(ranks, key=size.__getitem__)
        size[pick] += weight[index]
    return [[k for k, (key, offsets, *_) in enumerate(plan) if owner[(key, offsets)] == r]
            for r, plan in enumerate(plans)]


def check_duplicates(plans: list[list[Plain]]) -> None:
    """Chunks are deduplicated by (name, offsets): two ranks' chunks there must be the same
    chunk, or one would be dropped."""
    seen: dict[tuple, tuple] = {}
    for plan in plans:
        for key, offsets, sizes, *_ in plan:
            if seen.setdefault((key, offsets), sizes) != sizes:
                raise RuntimeError(f"{key}: two ranks hold different chunks at offsets "
                                   f"{offsets} ({sizes} and {seen[(key, offsets)]}); their "
                                   "regions must match")


@dataclass
class Layout:
    """One rank's part of a planned save (the same for every save of the layout)."""
    where: dict[Item, tuple[tuple, Chunk]]  # per item written: (its piece's place_of, chunk)
    files: list[tuple[str, list[Item]]]  # per data file: its name, its items (offsets set)
    metadata: MetadataFile | None  # the main rank's; None elsewhere


class MetadataFile:
    """DCP's `.metadata` of a layout, pickled once in a thread started at plan time: each
    save's bytes are it with a new save id (DCP's `StorageMeta.save_id`, a uuid of fixed
    length: the pickle's lengths stay valid)."""

    def __init__(self, metadata: Metadata):
        self._id = str(uuid.uuid4())
        metadata.storage_meta = StorageMeta(save_id=self._id)
        self.metadata = metadata
        self._bytes: bytes | BaseException = b""
        self._thread = threading.Thread(target=self._pickle, name="checkpoint-metadata",
                                        daemon=True)
        self._thread.start()

    def _pickle(self) -> None:
        try:
            self._bytes = pickle.dumps(self.metadata)
        except BaseException as e:  # raised by `for_save`
            self._bytes = e

    def for_save(self) -> bytes:
        """The pickled metadata with a fresh save id."""
        self._thread.join()
        if isinstance(self._bytes, BaseException):
            raise self._bytes
        old, new = self._id.encode(), str(uuid.uuid4()).encode()
        if len(old) != len(new) or self._bytes.count(old) != 1:
            raise RuntimeError("the pickled checkpoint metadata does not hold its save id once")
        return self._bytes.replace(old, new)


def global_plan(plans: list[list[Plain]], rank: int, main: bool
                ) -> tuple[list[int], list[tuple[str, list[Item]]], MetadataFile | None]:
    """This rank's kept chunks (positions in its plan), its files with each chunk's offset
    and, on the `main` rank, the checkpoint's metadata (every rank's offsets)."""
    check_duplicates(plans)
    kept = dedup(plans)
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    mine: list[tuple[str, list[Item]]] = []
    for r, (plan, keep) in enumerate(zip(plans, kept)):
        if not main and r != rank:
            continue
        items = []
        for k in keep:
            key, offsets, sizes, shape, dtype = plan[k]
            meta = tensors.get(key)
            if meta is None:
                meta = tensors[key] = TensorStorageMetadata(
                    TensorProperties(dtype=getattr(torch, dtype)), torch.Size(shape), [])
            index = MetadataIndex(key, torch.Size(offsets), len(meta.chunks))
            meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            items.append(Item(index, getattr(torch, dtype), sizes,
                              math.prod(sizes) * _itemsize(dtype)))
        files = [(f"__{r}_{j}{DEFAULT_SUFFIX}", run) for j, run in enumerate(place(items))]
        for name, run in files:
            for item in run:
                storage[item.index] = _StorageInfo(name, item.offset, item.stored)
        if r == rank:
            mine = files
    if not main:
        return kept[rank], mine, None
    return kept[rank], mine, MetadataFile(Metadata(tensors, storage_data=storage,
                                                   version=CURRENT_DCP_VERSION))


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for a block that allocates a few objects per
    chunk, none cyclic (planning, staging): triggered by the count of allocations, it
    would walk the process's whole heap (a model, torch) again and again -- half the
    planning time at 3,700 chunks."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def place_of(piece: Piece) -> tuple:
    """A piece's place in the full tensors: its name, box and first element (what a rank
    holds, whatever order its state lists it in)."""
    return (piece.region.key, piece.region.box, piece.region.start)


def local_digest(pieces: list[Piece]) -> bytes:
    """What the rank holds: each piece's region and dtype, in the order of their places (the
    chunks and the plan follow from them; a torch optimizer's state loaded from a
    checkpoint may list a parameter's moments in another order than the steps made them:
    the same holdings, the same plan)."""
    held = sorted((place_of(p), p.region.shape, p.region.stop, str(p.dtype)) for p in pieces)
    return _digest(repr(held).encode())


class PlanCache:
    """The last layout's plan, held across saves (module docstring); one per Saver."""

    def __init__(self):
        self.layout: Layout | None = None
        self.key: bytes | None = None  # the digest of the digests it was planned for
        self.planned = self.reused = 0  # saves planned afresh, saves that reused the plan

    def plan(self, rank: int, pieces: list[Piece],
             gather: Callable[[object], list]) -> Layout:
        """This rank's layout (a collective: `gather` returns every rank's object, in rank
        order)."""
        answers = gather((local_digest(pieces), self.key))
        key = _digest(b"".join(d for d, _ in answers))
        if self.layout is not None and all(held == key for _, held in answers):
            self.reused += 1
            return self.layout
        self.layout = self.key = None  # a failure below leaves no stale plan
        with collector_paused():
            self._plan(rank, pieces, gather, key)
        return self.layout

    def _plan(self, rank: int, pieces: list[Piece], gather: Callable[[object], list],
              key: bytes) -> None:
        where = [(k, c) for k, piece in enumerate(pieces) for c in region_chunks(piece.region)]
        plain = [(pieces[k].region.key, c.offsets, c.sizes, pieces[k].region.shape,
                  str(pieces[k].dtype).removeprefix("torch.")) for k, c in where]
        # As JSON text: one string to send, and ~10x faster to read back than the tuples
        # through the weights-only unpickler of the object exchange.
        plans = [[(name, tuple(o), tuple(s), tuple(sh), d)
                  for name, o, s, sh, d in json.loads(text)] for text in gather(json.dumps(plain))]
        kept, files, metadata = global_plan(plans, rank, rank == 0)
        items = [item for _, run in files for item in run]  # in `kept`'s order
        self.layout = Layout(dict(zip(items, ((place_of(pieces[where[k][0]]), where[k][1])
                                              for k in kept))), files, metadata)
        self.key = key
        self.planned += 1
