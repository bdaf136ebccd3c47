"""A save's plan (ckpt/saveplan.py): DCP's global plan on plain tuples, equal to DCP's own;
computed once per layout and reused while every rank holds the same pieces, planned
afresh when any rank's holdings change; the checkpoints it writes are DCP checkpoints
(dcp.load, DCP's reader, our Reader in another layout). Two ranks as threads of one
process: no process spawn."""

from __future__ import annotations

import json
import pickle
import threading
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from shardtrain.ckpt import dcp as ours
from shardtrain.ckpt.files import FORMAT, METADATA, SIDE, Piece, Reader
from shardtrain.ckpt.regions import Region, block_region
from shardtrain.ckpt.saveplan import PlanCache, global_plan

W, E = torch.randn(256, 512), torch.randn(1000).to(torch.bfloat16)  # 2 x 8 chunks; 1


def _write_item(key, offsets, sizes, shape, dtype) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape)))


def test_the_global_plan_is_dcps():
    """Replicated chunks (held by 2 or 3 ranks), tensors of different weights and dtypes:
    the chunks each rank keeps, their index hints and the metadata's tensors are those of
    DCP's dedup_save_plans + create_default_global_save_plan."""
    a = [("model/a", (r,), (1,), (8,), "float32") for r in range(8)]
    b = [("model/b", (r, 0), (1, 4), (4, 4), "bfloat16") for r in range(4)]
    c = [("optim/c", (0,), (3,), (3,), "float32")]
    plans = [a + c, a[2:] + b + c, b[::-1] + a[:5], c]
    theirs, meta = create_default_global_save_plan(
        dedup_save_plans([SavePlan([_write_item(*p) for p in plan]) for plan in plans]))
    for rank in range(len(plans)):
        kept, files, metadata = global_plan(plans, rank, main=True)
        mine = [item.index for _, run in files for item in run]
        assert [plans[rank][k][:2] for k in kept] == \
            [(i.index.fqn, tuple(i.index.offset)) for i in theirs[rank].items]
        assert [m.index for m in mine] == [i.index.index for i in theirs[rank].items]
        assert metadata.metadata.state_dict_metadata == meta.state_dict_metadata
    assert [len(p.items) for p in theirs] == [4, 4, 4, 1]  # 13 chunks, each once, spread


class _Ranks:
    """`size` ranks as threads: `gather` exchanges one object per rank, in rank order."""

    def __init__(self, size: int):
        self.size, self.box, self.barrier = size, {}, threading.Barrier(size)

    def gather(self, rank: int):
        def exchange(obj):
            self.box[rank] = obj
            self.barrier.wait()
            got = [self.box[r] for r in range(self.size)]
            self.barrier.wait()  # all read before the next exchange writes
            return got
        return exchange

    def run(self, work):
        def one(rank):
            try:
                return work(rank)
            except BaseException:
                self.barrier.abort()  # no rank left waiting for it
                raise
        return ours.in_threads([partial(one, r) for r in range(self.size)])


def _pieces(rank: int, split: int = 128) -> list[Piece]:
    """Rank 0 holds rows [0, split) of W, rank 1 the rest; both hold E (a replica)."""
    rows = (0, split) if rank == 0 else (split, 256 - split)
    w = W[rows[0]:rows[0] + rows[1]].reshape(-1)
    return [Piece(block_region("model/w", (256, 512), (rows, (0, 512))), torch.float32,
                  lambda: w),
            Piece(Region("model/e", (1000,), ((0, 1000),), 0, 1000), torch.bfloat16,
                  lambda: E)]


def _save(ranks: _Ranks, caches: list[PlanCache], directory: Path, split: int = 128,
          listed: int = 1):
    """`listed` -1: each rank lists its pieces in reverse (a torch optimizer's state
    loaded from a checkpoint may list a parameter's moments in another order)."""
    directory.mkdir()

    def work(rank):
        pieces = _pieces(rank, split)[::listed]
        planned = ours.plan_save(directory, rank, pieces, ranks.gather(rank), cache=caches[rank])
        planned.write()
        return planned
    planned = ranks.run(work)
    ours.finish(directory, planned[0].metadata, ranks.size, {SIDE: json.dumps(
        {"format": FORMAT, "aliases": {}, "extra": {}}).encode()})
    return planned


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load, one process
def test_the_plan_is_reused_until_a_rank_holds_other_pieces(tmp_path):
    ranks, caches = _Ranks(2), [PlanCache(), PlanCache()]
    _save(ranks, caches, tmp_path / "a")
    _save(ranks, caches, tmp_path / "b", listed=-1)  # the same layout: the plan reused
    assert [(c.planned, c.reused) for c in caches] == [(1, 1), (1, 1)]
    for name in sorted(p.name for p in (tmp_path / "a").iterdir()):
        a, b = ((tmp_path / d / name).read_bytes() for d in "ab")
        if name == METADATA:  # the same metadata but for DCP's save id
            a, b = (pickle.loads(x) for x in (a, b))
            assert a.storage_meta.save_id != b.storage_meta.save_id
            a.storage_meta = b.storage_meta = None
        assert a == b, name
    _save(ranks, caches, tmp_path / "c", split=64)  # rank 1 holds more of W: planned afresh
    assert [(c.planned, c.reused) for c in caches] == [(2, 1), (2, 1)]
    caches[1] = PlanCache()  # a rank without the plan: every rank plans, none waits
    _save(ranks, caches, tmp_path / "d", split=64)
    assert [(c.planned, c.reused) for c in caches] == [(3, 1), (1, 0)]
    written = {p.name: p.stat().st_size for p in (tmp_path / "d").glob("*.distcp")}
    assert sorted(written) == ["__0_0.distcp", "__1_0.distcp"]  # the replica E written once
    for directory in ("b", "d"):
        _check_readable(tmp_path / directory)


def _check_readable(path: Path) -> None:
    """dcp.load and DCP's reader read the tensors back; our Reader reads another layout's
    block (a column block of W, as a tensor-parallel rank would)."""
    state = {"model/w": torch.zeros(256, 512), "model/e": torch.zeros(1000, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    assert torch.equal(state["model/w"], W) and torch.equal(state["model/e"], E)
    meta = FileSystemReader(path).read_metadata()
    assert {k: tuple(m.size) for k, m in meta.state_dict_metadata.items()} == \
        {"model/w": (256, 512), "model/e": (1000,)}
    reader = Reader(path)
    assert torch.equal(reader.block("model/w", (256, 512), ((0, 256), (256, 256))),
                       W[:, 256:])
    assert reader.values_read == 256 * 256 * 4  # bytes: only the chunks of that block
