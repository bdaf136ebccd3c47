"""Automatic restart (`shardtrain train --max-restarts K`; `train.inject_kill`, train/guard.py): a 4-process run
loses one rank to SIGKILL after step 3; the launcher restarts the job, which resumes from
the step-2 checkpoint and finishes. Its final weights equal an uninterrupted run's bitwise
(fp32, CPU), and metrics.jsonl holds each step once. A crash in the middle of a checkpoint write leaves the previous checkpoint valid
and `latest`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest
import torch

from shardtrain.ckpt.files import Piece, write_pieces
from shardtrain.ckpt.regions import block_region
from shardtrain.train import checkpoint as ckpt
from tests.parity import checkpoint_tensors, tiny, tiny_data

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config", "tiny", "--train.steps", "6", "--checkpoint.every", "2",
        "--train.progress", "false"]


def _train(tmp: Path, name: str, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if kill:
        extra = (*extra, "--train.inject_kill", kill)
    return subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", "--nproc", "4", *ARGS, *extra,
         "--train.run_dir", str(tmp / name), *tiny_data(tmp)],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=600)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.read_meta(latest)["step"] == 6
    return checkpoint_tensors(latest, "")  # weights and optimizer state


def test_killed_rank_restarts_and_matches(tmp_path):
    plain = _train(tmp_path, "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    restarted = _train(tmp_path, "restarted", "--max-restarts", "1", kill="2:3")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "restart 1: resuming from latest" in restarted.stdout
    want, got = _final_weights(tmp_path / "plain"), _final_weights(tmp_path / "restarted")
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name} differs after the restart"
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "restarted" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_crash_mid_save_keeps_latest(tmp_path):
    """A save that dies while a rank writes its shard, or while the main rank commits,
    leaves no checkpoint directory (the files are staged, the manifest written last, the
    directory renamed into place after it), so `latest` is still the previous, loadable
    checkpoint; the same step then saves again over the stale staging directory."""
    cfg = tiny(tmp_path, "run")

    def save(step: int, fetch) -> None:
        region = block_region("model/w", (4,), ((0, 4),))
        write_pieces(ckpt.staging_dir(cfg, step), 0, [Piece(region, torch.float32, fetch)])
        ckpt.save_checkpoint(cfg, step=step, staged=ckpt.staging_dir(cfg, step), world_size=1,
                             layout={"zero": 0, "dp": 1, "tp": 1}, sampler_state={"step": step})

    def dying() -> torch.Tensor:
        raise KeyboardInterrupt("killed mid-write")

    save(2, lambda: torch.arange(4.0))
    with pytest.raises(KeyboardInterrupt):
        save(4, dying)
    with mock.patch.object(ckpt, "commit_manifest", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            save(6, lambda: torch.zeros(4))
    latest = ckpt.resolve_resume(dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="latest")))
    assert latest == ckpt.checkpoint_root(cfg.train.run_dir) / "step_00000002"
    assert ckpt.read_meta(latest)["step"] == 2
    assert torch.equal(checkpoint_tensors(latest)["w"], torch.arange(4.0))
    save(4, lambda: torch.ones(4))  # over the dead attempt's staged files
    assert torch.equal(checkpoint_tensors(ckpt.list_checkpoints(
        ckpt.checkpoint_root(cfg.train.run_dir))[-1])["w"], torch.ones(4))
