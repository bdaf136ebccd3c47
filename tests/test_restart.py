"""Automatic restart and graceful interrupt on 2 processes, against one uninterrupted run.

Restart (`shardtrain train --max-restarts K`; `train.inject_kill`, train/guard.py): rank 1
dies by SIGKILL after step 3; the launcher restarts the job, which resumes from the step-2
checkpoint and finishes. Interrupt (train/checkpoint/interrupt.py): a SIGTERM to the launcher mid-run
(as a scheduler's preemption) makes every rank stop after the same step with a checkpoint
of it, one line, exit 143, no traceback; the run then resumes. Both end with the
uninterrupted run's final weights and optimizer state bitwise (fp32, CPU), and
metrics.jsonl holds each step once, with the same losses. A crash in the middle of a
checkpoint write leaves the previous checkpoint valid and `latest`."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock
from pathlib import Path

import pytest
import torch

from shardtrain.ckpt.dcp import plan_save
from shardtrain.ckpt.files import Piece
from shardtrain.ckpt.regions import block_region
from shardtrain.train.checkpoint import checkpoint as ckpt
from tests.parity import checkpoint_tensors, tiny, tiny_data

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config", "tiny", "--train.steps", "6", "--checkpoint.every", "2",
        "--train.progress", "false"]


def _command(tmp: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardtrain", "train", "--nproc", "2", *ARGS, *extra,
            "--train.run_dir", str(tmp / name), *tiny_data(tmp)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _train(tmp: Path, name: str, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    if kill:
        extra = (*extra, "--train.inject_kill", kill)
    return subprocess.run(_command(tmp, name, *extra), env=_env(), cwd=tmp,
                          capture_output=True, text=True, timeout=600)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.read_meta(latest)["step"] == 6
    return checkpoint_tensors(latest, "")  # weights and optimizer state


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The uninterrupted run both tests compare with."""
    tmp = tmp_path_factory.mktemp("plain")
    run = _train(tmp, "plain")
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp / "plain"


def _matches(plain: Path, run_dir: Path) -> None:
    want, got = _final_weights(plain), _final_weights(run_dir)
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name} differs from the uninterrupted run's"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [r["loss"] for r in _records(plain)]


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_killed_rank_restarts_and_matches(tmp_path, plain):
    restarted = _train(tmp_path, "restarted", "--max-restarts", "1", kill="1:3")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "restart 1: resuming from latest" in restarted.stdout
    _matches(plain, tmp_path / "restarted")


@pytest.mark.slow  # README command's time (30 s); test_interrupt.py's Ctrl-C stays there
def test_sigterm_saves_every_rank_at_one_step_and_resumes_bitwise(tmp_path, plain):
    # Rank 0 sleeps 3 s at the start of step 3: the signal lands mid-run, whatever the load.
    proc = subprocess.Popen(_command(tmp_path, "run", "--train.inject_hang", "0:3:3"),
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(_records(tmp_path / "run")) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler's preemption does
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("SIGTERM")]
    assert len(lines) == 1, out
    stopped = ckpt.read_meta(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1])["step"]
    assert 2 <= stopped < 6 and f"stopped after step {stopped}," in lines[0]
    assert "--checkpoint.resume latest" in lines[0]
    assert len(_records(tmp_path / "run")) == stopped  # every rank stopped after that step
    resumed = _train(tmp_path, "run", "--checkpoint.resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _matches(plain, tmp_path / "run")


def test_crash_mid_save_keeps_latest(tmp_path):
    """A save that dies while a rank writes its shard, or while the main rank commits,
    leaves no checkpoint directory (the files are staged, the metadata and side files written last, the
    directory renamed into place after it), so `latest` is still the previous, loadable
    checkpoint; the same step then saves again over the stale staging directory."""
    cfg = tiny(tmp_path, "run")

    def save(step: int, fetch) -> None:
        region = block_region("model/w", (4,), ((0, 4),))
        staged = ckpt.staging_dir(cfg, step)
        planned = plan_save(staged, 0, [Piece(region, torch.float32, fetch)], lambda p: [p])
        planned.write()
        ckpt.save_checkpoint(cfg, step=step, staged=staged, world_size=1,
                             metadata=planned.metadata, aliases={}, extra={},
                             layout={"zero": 0, "dp": 1, "tp": 1}, sampler_state={"step": step})

    def dying() -> torch.Tensor:
        raise KeyboardInterrupt("killed mid-write")

    save(2, lambda: torch.arange(4.0))
    with pytest.raises(KeyboardInterrupt):
        save(4, dying)
    with mock.patch.object(ckpt, "finish", side_effect=KeyboardInterrupt):
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
