"""Checkpoint integrity: damaged checkpoints refused naming the file, resume = latest
falling back past a corrupt newest one (found by content, agreed across ranks), per-chunk
CRC-32s computed as written, and the model fields a resume compares."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dist import run_distributed
from parity import checkpoint_tensors, make_mesh, tiny
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.trainer import Trainer

STEPS = ("--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2")


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _digest(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path, capsys):
    cfg = tiny(tmp_path, "saved", "--train.steps", "2")
    Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run()
    good = _step(tmp_path / "saved", 2)

    def resume(path: Path, *overrides: str) -> str:
        before = _digest(tmp_path / "saved")
        other = tiny(tmp_path, "resumed", "--train.steps", "4", *overrides,
                     "--checkpoint.resume", str(path))
        with pytest.raises(ConfigError) as err:
            ckpt.check_compatible(path, other, 1)
            Trainer(other, make_mesh(other, 0, 1), torch.device("cpu"))
        assert _digest(tmp_path / "saved") == before  # nothing overwritten
        assert not (tmp_path / "resumed" / "checkpoints").exists()
        return str(err.value)

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy)
        return copy

    shard = "__0_0.distcp"

    def flip(d: Path) -> None:  # inside a chunk's values: found by its checksum as read
        data = bytearray((d / shard).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (d / shard).write_bytes(bytes(data))

    def truncate(d: Path) -> None:
        (d / shard).write_bytes((d / shard).read_bytes()[:-100])

    msg = resume(damaged("flipped", flip))
    assert shard in msg and "checksum" in msg
    msg = resume(damaged("truncated", truncate))
    assert shard in msg and "incomplete" in msg
    msg = resume(damaged("missing", lambda d: (d / shard).unlink()))
    assert shard in msg and "missing" in msg
    msg = resume(damaged("no-metadata", lambda d: (d / ".metadata").unlink()))
    assert ".metadata" in msg and "missing" in msg
    msg = resume(damaged("bad-metadata", lambda d: (d / ".metadata").write_bytes(b"{")))
    assert ".metadata" in msg and "not readable" in msg
    msg = resume(damaged("old-format", lambda d: [
        (d / n).unlink() for n in (".metadata", "shardtrain.json")] and
        (d / "manifest.json").write_text("{}")))
    assert "earlier format" in msg and "985e675" in msg
    msg = resume(good, "--model.dim", "32")
    assert "model.dim: checkpoint 64 vs config 32" in msg

    # resume = latest falls back past a newest checkpoint a crash left truncated: every
    # process skips it, the main one moves it aside (kept) and says so on one line.
    root = tmp_path / "fallback" / "checkpoints"
    for step in (2, 4):
        shutil.copytree(good, root / f"step_{step:08d}")
    truncate(root / "step_00000004")
    latest = tiny(tmp_path, "fallback", "--checkpoint.resume", "latest")
    capsys.readouterr()
    assert ckpt.resolve_resume(latest, main=False) == root / "step_00000002"
    assert (root / "step_00000004").is_dir()  # only the main process moves it
    assert ckpt.resolve_resume(latest) == root / "step_00000002"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "step_00000004 is not usable" in out, out
    assert "moved to bad-step_00000004, resuming from step_00000002" in out and shard in out
    assert sorted(p.name for p in root.iterdir()) == ["bad-step_00000004", "step_00000002"]
    truncate(root / "step_00000002")  # nothing left to fall back to: the error, nothing moved
    with pytest.raises(ConfigError, match="incomplete"):
        ckpt.resolve_resume(latest)
    assert (root / "step_00000002").is_dir()



def _fallback_past_a_corrupt_newest(rank: int, world_size: int, tmp: str) -> dict:
    """Worker (dp = 2): train to step 4 (checkpoints 2 and 4), flip a byte late in rank
    1's data file of step 4 -- in the share rank 1 verifies, so rank 0 learns of it only
    through the agreement -- and resume `latest`: both ranks fall back to step 2."""
    import contextlib
    import io

    import torch.distributed as dist

    cfg = tiny(Path(tmp), "run", *STEPS)
    first = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu")).run().losses
    newest = _step(Path(tmp) / "run", 4)
    want = checkpoint_tensors(newest, "") if rank == 0 else None
    dist.barrier()
    if rank == 0:
        shard = newest / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) * 3 // 4] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    cfg = tiny(Path(tmp), "run", *STEPS, "--checkpoint.resume", "latest")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # what resuming printed
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    losses = trainer.run().losses
    return {"first": first, "resumed": losses, "printed": out.getvalue(), "want": want}


def test_resume_latest_falls_back_past_a_corrupt_newest_checkpoint(tmp_path):
    """A flipped byte in the newest checkpoint's data (same size: `validate` cannot see it)
    is found by resume's content check, split over the ranks; the checkpoint is moved aside
    with one line and the run resumes from the one before, ending as the uninterrupted run."""
    results = run_distributed(_fallback_past_a_corrupt_newest, 2, str(tmp_path))
    root = tmp_path / "run" / "checkpoints"
    printed = results[0]["printed"]
    assert printed.count("\n") == 1 and results[1]["printed"] == "", results
    assert "step_00000004 is not usable" in printed and "__1_0.distcp" in printed
    assert "do not match their checksum" in printed
    assert "moved to bad-step_00000004, resuming from step_00000002" in printed
    assert (root / "bad-step_00000004").is_dir()
    for r in results:
        assert r["resumed"] == r["first"][2:]
    got = checkpoint_tensors(_step(tmp_path / "run", 4), "")
    for name, w in results[0]["want"].items():
        assert torch.equal(got[name], w), name



def test_resume_compares_only_the_fields_of_the_saved_tensors(tmp_path):
    """model.init_from's path (a moved base model) and model.moe_impl do not block a
    resume; a field of the saved tensors does; every model field is classed once."""
    import dataclasses

    from shardtrain.config.model import ModelConfig

    saved = tiny(tmp_path, "a")
    saved.model.init_from = "/old/place/base"
    saved.model.n_heads = saved.model.n_kv_heads = 2
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.toml").write_text(config.to_toml(saved))
    (path / "meta.json").write_text(json.dumps({"layout": {"zero": 0, "pp": 1, "dp": 1,
                                                           "tp": 1}}))
    now = tiny(tmp_path, "b", "--model.moe_impl", "loop", "--model.n_kv_heads", "0",
               "--model.n_heads", "2")
    now.model.init_from = "/new/place/base"
    ckpt.check_compatible(path, now, 1)  # n_kv_heads 0 means n_heads: the same tensors
    now.model.norm_eps = 1e-6
    with pytest.raises(ConfigError, match=r"model.norm_eps: checkpoint 1e-05 vs config 1e-06"):
        ckpt.check_compatible(path, now, 1)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(ckpt.MODEL_STATE_FIELDS) | set(ckpt.MODEL_FREE_FIELDS) == fields
    assert not set(ckpt.MODEL_STATE_FIELDS) & set(ckpt.MODEL_FREE_FIELDS)


def test_checksums_are_computed_as_written_and_own_files_checked(tmp_path):
    """Each chunk's CRC-32 comes from the bytes as they were written (no read back), equal
    to the file's; `verify` checks own state files that have a CRC-32 and passes those of a
    checkpoint written before they had one."""
    from unittest import mock

    from shardtrain.ckpt import dcp
    from shardtrain.ckpt.files import CHECKSUMS, Piece, verify
    from shardtrain.ckpt.regions import block_region

    cfg = tiny(tmp_path, "run")
    staged = ckpt.staging_dir(cfg, 2)
    region = block_region("model/w", (256, 256), ((0, 256), (0, 256)))  # 4 chunks
    planned = dcp.plan_save(staged, 0, [Piece(region, torch.float32,
                                              lambda: torch.randn(256 * 256))], lambda p: [p])
    sums = ckpt.stage_files(cfg, 2, {"own.pt": {"x": torch.ones(3)}})
    reads = []
    real_open = open

    def watched(path, mode="r", *args, **kwargs):  # no data file is opened for reading
        reads.append(str(path)) if "r" in mode and ".distcp" in str(path) else None
        return real_open(path, mode, *args, **kwargs)
    with mock.patch("builtins.open", watched):
        planned.write(sums)
    assert not reads
    path = ckpt.save_checkpoint(cfg, step=2, staged=staged, world_size=1,
                                metadata=planned.metadata, aliases={}, extra={},
                                layout={"zero": 0, "dp": 1, "tp": 1}, sampler_state={})
    written = json.loads((path / CHECKSUMS).read_text())
    chunks = FileSystemReader(path).read_metadata().storage_data
    assert len(written) == len(chunks) + 1 > 2  # the chunks, and own.pt
    for rank in (0, 1, 2):
        verify(path, rank, 3)
    own = bytearray((path / "own.pt").read_bytes())
    own[len(own) // 2] ^= 0x01
    (path / "own.pt").write_bytes(bytes(own))
    with pytest.raises(ConfigError, match="own.pt: the bytes at 0 do not match"):
        for rank in (0, 1):
            verify(path, rank, 2)
    del written["own.pt"]  # as a checkpoint written before own files had checksums
    (path / CHECKSUMS).write_text(json.dumps(written))
    verify(path)
