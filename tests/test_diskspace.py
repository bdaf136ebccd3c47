"""A failed checkpoint save (train/checkpoint/diskspace.py): refused before writing when the
free space is short; an ENOSPC or any other error during a write (a patched writer raises
it), synchronous or asynchronous, stops every rank at the same point with the same error
naming the rank and the cause, one message on the main rank, the staging directory
removed, the last good checkpoint intact; resume works once space is back."""

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
from shardtrain.train.checkpoint.diskspace import SaveFailed

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
EIO = OSError(errno.EIO, os.strerror(errno.EIO))


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", "tiny", "--train.steps", "6", "--checkpoint.every", "2",
            "--train.run_dir", str(tmp / "run"), *tiny_data(tmp), *extra]


def _leftovers(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _fail_at(step: int, real, error: OSError = ENOSPC):
    """`real` (SavePlanned.write), raising `error` when it writes into step `step`'s
    directory."""
    def write(planned, *args, **kwargs):
        if f"step_{step:08d}" in str(planned.directory):
            raise error
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


SCENARIOS = {  # run dir: (checkpoint.async_save, the error of rank 1's write at step 4)
    "sync-full": ("false", ENOSPC), "sync-eio": ("false", EIO),
    "async-eio": ("true", EIO), "async-full": ("true", ENOSPC),
}


def failures_on_rank_1(rank: int, world_size: int, tmp: str) -> dict:
    """Worker: in each scenario rank 1's shard write fails at step 4; where each rank
    stopped and with what."""
    from shardtrain.train.trainer import Trainer

    seen = {}
    for name, (async_save, error) in SCENARIOS.items():
        cfg = config.loads(config.to_toml(tiny(Path(tmp), name, "--train.steps", "6",
                                               "--checkpoint.every", "2",
                                               "--checkpoint.async_save", async_save)))
        real = SavePlanned.write
        patched = _fail_at(4, real, error) if rank == 1 else real
        with mock.patch.object(SavePlanned, "write", patched):
            trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
            try:
                trainer.run()
            except SaveFailed as e:
                seen[name] = {"step": trainer.step, "kind": type(e).__name__, "message": str(e)}
                continue
        seen[name] = {"step": trainer.step, "kind": None, "message": None}
    return seen


def test_a_write_error_on_one_rank_of_two_stops_both_at_the_same_save(tmp_path):
    """A full disk or an I/O error in rank 1's write, in a synchronous or an asynchronous
    save: both ranks raise the same error, naming the rank and the cause, at the same
    point -- that save, or for an asynchronous one the next save -- within the test's
    short timeout (the communication timeout is 300 s: nobody waits for it)."""
    stale = tmp_path / "sync-full" / "checkpoints" / ".staged-step_00000009"
    stale.mkdir(parents=True)  # left by an earlier crash: removed at start
    results = run_distributed(failures_on_rank_1, 2, str(tmp_path), timeout_s=120)
    for name, (async_save, error) in SCENARIOS.items():
        first, second = (r[name] for r in results)
        assert first == second, name  # the same step, error and message on both ranks
        assert first["step"] == (6 if async_save == "true" else 4), (name, first)
        message = first["message"]
        assert "checkpoint of step 4 not written" in message, message
        assert "step_00000002, is intact" in message, message
        if error is ENOSPC:
            assert first["kind"] == "DiskFull" and "(on 1 rank(s), rank 1 among them)" in message
        else:
            assert first["kind"] == "SaveFailed", first
            assert "rank 1 could not write its part ([Errno 5] Input/output error)" in message
        run_dir = tmp_path / name
        assert _leftovers(run_dir) == []
        assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == \
            ["step_00000002"]
