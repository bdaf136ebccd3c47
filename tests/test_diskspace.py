"""A full disk during a checkpoint (train/checkpoint/diskspace.py): refused before writing when the
free space is short, and an ENOSPC during a write (a patched writer raises it) stops every
rank at the same save with one message on the main rank, the staging directory removed,
the last good checkpoint intact; resume works once space is back."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from unittest import mock

import torch

from dist import run_distributed
from parity import make_mesh, tiny, tiny_data
from shardtrain import config
from shardtrain.ckpt.dcp import SavePlanned
from shardtrain.ckpt.files import Reader
from shardtrain.cli import main
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.diskspace import DiskFull

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", "tiny", "--train.steps", "6", "--checkpoint.every", "2",
            "--train.run_dir", str(tmp / "run"), *tiny_data(tmp), *extra]


def _leftovers(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _fail_at(step: int, real):
    """`real` (SavePlanned.write), raising ENOSPC when it writes into step `step`'s
    directory."""
    def write(planned, *args, **kwargs):
        if f"step_{step:08d}" in str(planned.directory):
            raise ENOSPC
        return real(planned, *args, **kwargs)
    return write


def test_enospc_while_writing_stops_cleanly_and_resume_works(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with mock.patch.object(SavePlanned, "write", _fail_at(4, SavePlanned.write)):
        assert main(_args(tmp_path)) == 74
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "checkpoint of step 4 not written: No space left on device" in err
    assert f"{run_dir / 'checkpoints' / 'step_00000002'}, is intact" in err
    assert "checkpoint.keep" in err and "train.run_dir" in err
    assert _leftovers(run_dir) == []  # the staging directory removed
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]
    good = run_dir / "checkpoints" / "step_00000002"
    reader = Reader(good)
    assert all(reader.tensor(k).isfinite().all() for k in reader.keys("model/"))

    # A failure in the main rank's commit (after the shards were staged) is handled alike.
    with mock.patch.object(ckpt, "finish", side_effect=ENOSPC):
        assert main(_args(tmp_path, "--checkpoint.resume", "latest")) == 74
    assert "checkpoint of step 4 not written" in capsys.readouterr().err
    assert _leftovers(run_dir) == []

    # Space is back: resume from the intact checkpoint and finish.
    assert main(_args(tmp_path, "--checkpoint.resume", "latest")) == 0
    assert ckpt.read_meta(ckpt.list_checkpoints(run_dir / "checkpoints")[-1])["step"] == 6


def test_free_space_is_checked_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with mock.patch("shardtrain.train.checkpoint.diskspace._free_bytes", return_value=1000):
        assert main(_args(tmp_path)) == 74
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "checkpoint of step 2 not written" in err and "has 1,000 free" in err
    assert "no checkpoint was written yet" in err
    assert not (run_dir / "checkpoints").exists() or _leftovers(run_dir) == []


def stale_staging_and_enospc_on_rank_1(rank: int, world_size: int, tmp: str) -> dict:
    """Worker: rank 1's shard write fails at step 4; what each rank saw."""
    cfg = config.loads(config.to_toml(tiny(Path(tmp), "run", "--train.steps", "6",
                                           "--checkpoint.every", "2")))
    from shardtrain.train.trainer import Trainer

    real = SavePlanned.write
    patched = _fail_at(4, real) if rank == 1 else real
    with mock.patch.object(SavePlanned, "write", patched):
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
        try:
            trainer.run()
        except DiskFull as e:
            return {"step": trainer.step, "message": str(e)}
    return {"step": trainer.step, "message": None}


def test_enospc_on_one_rank_of_two_stops_both_at_the_same_save(tmp_path):
    stale = tmp_path / "run" / "checkpoints" / ".staged-step_00000009"
    stale.mkdir(parents=True)  # left by an earlier crash: removed at start
    results = run_distributed(stale_staging_and_enospc_on_rank_1, 2, str(tmp_path))
    assert [r["step"] for r in results] == [4, 4]
    assert all(r["message"] and "on 1 rank(s)" in r["message"] for r in results)
    assert _leftovers(tmp_path / "run") == []
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == \
        ["step_00000002"]
