"""GPU check of a checkpoint round trip through the CLI: `shardtrain train` (ZeRO-3, bf16)
trains 4 steps of the tiny preset on the device saving at steps 2 and 4 asynchronously
(DCP's staging, the write on another thread); a second `shardtrain train` resumes the
step-2 checkpoint to step 4 and saves it synchronously (benchmarks/gpu/sweep.py resumes
from such a one). The resumed step 3's loss, a forward of the restored weights
on the restored sampler's batch, equals the first run's; step 4 (after an optimizer step
from the restored state) and the eval loss agree within bf16's run-to-run noise on a GPU
(backward kernels with atomics are not bitwise deterministic).

The CPU twin is the same commands with `--train.device cpu`. The commands run in this
process (`shardtrain.cli.main`, what `python -m shardtrain` calls), as the check does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parity import tiny_data
from shardtrain.cli import main


@pytest.fixture
def threads(monkeypatch):
    """The test session's one thread stays (tests/conftest.py): a one-process CLI run on
    the CPU would take every core (shardtrain.launch.init_distributed), 10x slower in thread
    hand-offs on a busy machine."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


def _train(run_dir: Path, device: torch.device, async_save: bool, *extra: str) -> list[dict]:
    argv = ["train", "--config", "tiny", "--train.run_dir", str(run_dir), *tiny_data(run_dir),
            "--train.device", device.type, "--train.steps", "4", "--train.log_every", "1",
            "--checkpoint.every", "2", "--checkpoint.async_save", str(async_save).lower(),
            "--parallel.zero", "3", "--train.precision", "bf16", *extra]
    assert main(argv) == 0, argv
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_async_save_then_resume(tmp_path, device, threads):
    first = _train(tmp_path / "first", device, True)
    step2 = tmp_path / "first" / "checkpoints" / "step_00000002"
    resumed = _train(tmp_path / "resumed", device, False, "--checkpoint.resume", str(step2))
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]
    print(f"\n{device.type}: losses {[r['loss'] for r in first]}, resumed "
          f"{[r['loss'] for r in resumed]}")
    assert resumed[0]["loss"] == pytest.approx(first[2]["loss"], rel=1e-6)
    assert resumed[1]["loss"] == pytest.approx(first[3]["loss"], rel=1e-2)
    assert resumed[1]["eval_loss"] == pytest.approx(first[3]["eval_loss"], rel=1e-2)
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()) == \
        ["step_00000004"]
