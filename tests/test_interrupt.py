"""Graceful interrupt and preemption (train/interrupt.py): SIGINT or SIGTERM stops every
rank after the same step, with a checkpoint of it, one line saying where and how to
resume, exit 130 / 143, no traceback; the resumed run ends where an uninterrupted one does,
bitwise (fp32, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from parity import checkpoint_tensors, tiny_data
from shardtrain.cli import main
from shardtrain.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _command(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardtrain", "train", "--nproc", "2", "--config", "tiny",
            "--train.steps", str(STEPS), "--train.run_dir", str(tmp / "run"), *tiny_data(tmp),
            *extra]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.read_meta(latest)["step"] == STEPS
    return checkpoint_tensors(latest, "")  # weights and optimizer state


def test_sigterm_on_two_processes_saves_and_resumes_bitwise(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = subprocess.run(_command(plain_dir), env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # Rank 0 sleeps 3 s at the start of step 6: the signal lands mid-run, whatever the load.
    proc = subprocess.Popen(_command(tmp_path, "--train.inject_hang", "0:6:3"), env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    while _steps_done(tmp_path / "run") < 5 and proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not reach step 5"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler's preemption does
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("SIGTERM")]
    assert len(lines) == 1, out
    saved = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    stopped = ckpt.read_meta(saved[-1])["step"]
    assert 5 <= stopped < STEPS and f"stopped after step {stopped}" in lines[0]
    assert "--checkpoint.resume latest" in lines[0]
    assert _steps_done(tmp_path / "run") == stopped  # every rank stopped after that step

    resumed = subprocess.run(_command(tmp_path, "--checkpoint.resume", "latest"), env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _final(plain_dir / "run"), _final(tmp_path / "run")
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name} differs after the interrupted run resumed"
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in
                      (plain_dir / "run" / "metrics.jsonl").read_text().splitlines()]


def test_ctrl_c_on_one_process_saves_and_exits_130(tmp_path, capsys):
    run_dir = tmp_path / "run"

    def interrupt_at_step_3() -> None:
        while _steps_done(run_dir) < 3:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, as Ctrl-C is

    thread = threading.Thread(target=interrupt_at_step_3, daemon=True)
    thread.start()
    code = main(["train", "--config", "tiny", "--train.steps", "400", "--train.run_dir",
                 str(run_dir), *tiny_data(tmp_path)])
    thread.join()
    assert code == 130
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("SIGINT")]
    assert len(lines) == 1 and "done:" not in out, out
    step = ckpt.read_meta(ckpt.list_checkpoints(run_dir / "checkpoints")[-1])["step"]
    assert 3 <= step < 400 and f"stopped after step {step}" in lines[0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
