"""A save's staging (ckpt/stream.py): bounded by checkpoint.staging_mb whatever the share,
chunks larger than a buffer streamed in parts, every stored chunk framed as torch.save
would (frames.py), NVMe-offloaded state mapped rather than read whole, and the pool's
memory in the planner and the launch-time fit check. No process spawn."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch.utils.serialization import config as serialization_config

from parity import tiny
from shardtrain.ckpt import dcp
from shardtrain.ckpt.files import FORMAT, SIDE, Piece, Reader, verify
from shardtrain.ckpt.frames import frame, raw_bytes
from shardtrain.ckpt.regions import Region, block_region
from shardtrain.config import ConfigError, OptimConfig
from shardtrain.parallel.zero.offload import HostOptimizer
from shardtrain.plan.checkpoint_io import checkpoint_staging_bytes
from shardtrain.plan.layout import config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.train.start.fits import check_fits, rank_capacity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(), (3,), (4, 5), (512, 1024)])  # the last: >= 1 MiB
def test_a_framed_chunk_is_torch_saves_archive(dtype, shape):
    """header + raw values + trailer is byte for byte torch.save's archive (its record
    CRC-32s left out) and loads back with torch.load."""
    values = (torch.randn(shape) * 100).to(dtype)
    f = frame(dtype, shape)
    framed = f.header + bytes(raw_bytes(values.contiguous())) + f.trailer
    saved = io.BytesIO()
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(values, saved)
    assert framed == saved.getvalue()
    assert torch.equal(torch.load(io.BytesIO(framed), weights_only=True), values)


def _commit(directory: Path, planned) -> Reader:
    dcp.finish(directory, planned.metadata, 1)
    (directory / SIDE).write_text(json.dumps({"format": FORMAT, "aliases": {}, "extra": {}}))
    verify(directory)  # every stored chunk's bytes against the CRC-32 computed as written
    return Reader(directory)


def test_staging_is_bounded_and_an_async_snapshot_is_whole(tmp_path):
    """A 4.6 MiB share staged through 256 KiB: at no moment more staged; a chunk of 1 MiB
    goes in parts; the live tensors changed once `start` returns leave the checkpoint as
    it was staged; the same save unbounded stages the whole share at once."""
    torch.manual_seed(0)
    w = torch.randn(512, 2048)  # 4 MiB: 8 x 8 chunks of 64 KiB
    v = torch.randn(1 << 18)  # 1 MiB: one chunk of a 1-D tensor, larger than the pool
    h = torch.randn(300).to(torch.bfloat16)
    want = [w.clone(), v.clone(), h.clone()]
    pieces = [Piece(block_region("model/w", (512, 2048), ((0, 512), (0, 2048))),
                    torch.float32, lambda: w),
              Piece(block_region("model/v", (1 << 18,), ((0, 1 << 18),)), torch.float32,
                    lambda: v),
              Piece(Region("model/h", (300,), ((0, 300),), 0, 300), torch.bfloat16, lambda: h)]
    share = 4 * (512 * 2048 + (1 << 18)) + 2 * 300
    for budget, name in ((256 << 10, "bounded"), (None, "whole")):
        directory = tmp_path / name
        directory.mkdir()
        planned = dcp.plan_save(directory, 0, pieces, lambda p: [p], staging_bytes=budget)
        planned.start()
        for t in (w, v, h):
            t.zero_()  # the step loop goes on
        planned.write()
        reader = _commit(directory, planned)
        for key, t in zip(("model/w", "model/v", "model/h"), want):
            assert torch.equal(reader.tensor(key), t), (name, key)
        for t, saved in zip((w, v, h), want):
            t.copy_(saved)
        if budget is not None:
            assert 0 < planned.staged_peak <= budget
        else:
            assert planned.staged_peak >= share


def test_staging_mb_is_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.staging_mb=0 must be >= 1.*"
                                          r"--checkpoint.staging_mb"):
        tiny(tmp_path, "run", "--checkpoint.staging_mb", "0").validate(1)


def test_nvme_state_is_mapped_not_read_whole(tmp_path):
    """The checkpoint's view of an NVMe-offloaded shard is its file, mapped: no copy of
    the state in memory (the save streams it into its staging buffers)."""
    masters = [torch.randn(1000), torch.randn(500)]
    opt = HostOptimizer(masters, [[], []], OptimConfig(), offload="nvme",
                        directory=str(tmp_path), stream_numel=64)
    state = opt.shard_state(1)
    maps = Path("/proc/self/maps").read_text().splitlines()
    for name, t in state.items():
        at = t.data_ptr()
        mapped = [line for line in maps if int(line.split()[0].split("-")[0], 16) <= at
                  < int(line.split()[0].split("-")[1], 16)]
        assert mapped and str(opt.shards[1].path) in mapped[0], name
    assert torch.equal(state["master"], masters[1])
    opt.close()


def test_the_staging_pool_is_planned_and_checked_before_launch(tmp_path):
    """The planner's host figure holds the pool (min of staging_mb and the share); on CPU
    the fit check adds it, naming it, and refuses a pool no machine has."""
    wide = ("--model.dim", "256")  # a share of 18 MiB (planner arithmetic only: no build)
    cfg = tiny(tmp_path, "run", *wide)
    layout = config_layout(cfg, 1)
    small = memory_per_gpu(cfg.model, layout, seq_len=cfg.train.seq_len, staging_bytes=1024)
    big = memory_per_gpu(cfg.model, layout, seq_len=cfg.train.seq_len, staging_bytes=2**50)
    share = big.params + big.master + big.optimizer + big.offloaded
    assert big.host - small.host == pytest.approx(share - 1024)
    assert checkpoint_staging_bytes(big, 1024) == 1024
    # A machine shared by so many ranks that the state fits with a pool of 1 MiB and not
    # with one of the whole share (then the largest term: 12 bytes per parameter).
    assert share > 2 * 2**20
    memory, _ = rank_capacity("cpu", 1)
    ranks = int(memory // (small.total + (share + 2**20) / 2))
    check_fits(tiny(tmp_path, "run", *wide, "--checkpoint.staging_mb", "1"), 1,
               device_kind="cpu", local_ranks=ranks)
    whole = tiny(tmp_path, "run", *wide, "--checkpoint.staging_mb", str(2**30))
    with pytest.raises(ConfigError, match=r"\(checkpoint staging .* GiB.*checkpoint.staging"):
        check_fits(whole, 1, device_kind="cpu", local_ranks=ranks)
