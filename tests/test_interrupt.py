"""Graceful interrupt (train/checkpoint/interrupt.py) on one process: Ctrl-C stops after the current
step with a checkpoint, one line, exit 130, and the handlers are put back. The 2-process
SIGTERM run, resumed bitwise against an uninterrupted run, is in test_restart.py (it shares
that file's uninterrupted run)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from parity import tiny_data
from shardtrain.cli import main
from shardtrain.train.checkpoint import checkpoint as ckpt


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_ctrl_c_on_one_process_saves_and_exits_130(tmp_path, capsys):
    run_dir = tmp_path / "run"

    def interrupt_at_step_3() -> None:
        while _steps_done(run_dir) < 3:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, as Ctrl-C is

    before = signal.getsignal(signal.SIGINT)  # (an earlier in-process launch may have set one)
    thread = threading.Thread(target=interrupt_at_step_3, daemon=True)
    thread.start()
    code = main(["train", "--config", "tiny", "--train.steps", "400", "--train.run_dir",
                 str(run_dir), "--train.peak_flops", "1e12", *tiny_data(tmp_path)])
    thread.join()
    assert code == 130
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("SIGINT")]
    assert len(lines) == 1 and "done:" not in out, out
    step = ckpt.read_meta(ckpt.list_checkpoints(run_dir / "checkpoints")[-1])["step"]
    assert 3 <= step < 400 and f"stopped after step {step}" in lines[0]
    assert signal.getsignal(signal.SIGINT) is before  # put back
