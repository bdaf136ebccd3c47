"""Graceful interrupt (train/checkpoint/interrupt.py) on one process: Ctrl-C stops after the current
step with a checkpoint, one line, exit 130, and the handlers are put back. The 2-process
SIGTERM run, resumed bitwise against an uninterrupted run, is in test_restart.py (it shares
that file's uninterrupted run). Two ranks' agreement on the step, with no step waiting for
the store, is checked in-process over a HashStore."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from parity import tiny_data
from shardtrain.cli import main
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.interrupt import LAG, Interrupt


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


class _Store:
    """A job's store (a HashStore), recording which thread makes each call."""

    def __init__(self):
        self.store, self.calls = dist.HashStore(), []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, threading.current_thread() is threading.main_thread()))
            return getattr(self.store, name)(*args)
        return call


@pytest.mark.parametrize("proposer_first", [True, False])
def test_ranks_stop_after_one_step_and_no_step_waits_for_the_store(monkeypatch,
                                                                   proposer_first):
    """Two ranks' interrupts over one store, each step's calls in either order (a rank may
    end a step before or after the proposer): rank 0 sees SIGTERM in step 3; both stop
    after step 3 + LAG. The training thread calls the store once, to propose; every read
    is made on a thread of its own."""
    store = _Store()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    ranks = [Interrupt(world_size=2) for _ in range(2)]
    stopped = {}
    for step in range(1, 8):
        if step == 3:
            ranks[0].signum = signal.SIGTERM
        for r in (0, 1) if proposer_first else (1, 0):
            if r not in stopped and ranks[r].stop_after(step):
                stopped[r] = step
    assert stopped == {0: 3 + LAG, 1: 3 + LAG} and ranks[1].signum == signal.SIGTERM
    assert [name for name, main in store.calls if main] == ["compare_set"]
    assert {name for name, main in store.calls if not main} == {"check", "get"}
