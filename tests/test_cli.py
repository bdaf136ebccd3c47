"""The command line: bad input fails before any training with a message naming the field
or file; `--nproc 2` and torchrun train end to end; `generate` samples a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity import tiny_data
from shardtrain.cli import main


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", "tiny", "--train.run_dir", str(tmp / "run"),
            *tiny_data(tmp), *extra]


def _fails(capsys, argv: list[str], needle: str, tmp: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp / "run").exists()  # nothing trained, no empty run dir left behind


@pytest.mark.parametrize("extra, needle", [
    (["--train.stepz", "3"], "unknown field in [train] 'stepz'; did you mean 'steps'"),
    (["--parallel.dp", "3"], "dp=3 x tp=1 x pp=1 x cp=1 = 3 does not equal the world size 1"),
    (["--model.n_kv_heads", "3"], "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    (["--train.global_batch", "9"], "train.global_batch=9 is not divisible by train.micro_batch=2"),
    (["--parallel.sp", "true"], "parallel.sp=true needs parallel.tp > 1"),
    (["--data.source", "/nonexistent/corpus.txt"], "data.source"),
    (["--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer"),
])
def test_bad_input_is_named_before_training(tmp_path, capsys, extra, needle):
    _fails(capsys, _args(tmp_path, *extra), needle, tmp_path)


def test_data_without_text_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(capsys, _args(tmp_path, "--data.source", str(empty)), str(empty), tmp_path)


def test_tokenizer_larger_than_the_model_vocab_is_named(tmp_path, capsys):
    _fails(capsys, _args(tmp_path, "--data.tokenizer", "bpe", "--data.bpe_vocab_size", "300",
                         "--data.max_bytes", "100000"),
           "model.vocab_size=256 is smaller than the tokenizer's vocabulary", tmp_path)


def test_unwritable_run_dir_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    argv = _args(tmp_path, "--train.run_dir", str(blocker / "run"))
    assert main(argv) == 2
    assert "train.run_dir" in capsys.readouterr().err


def test_resume_with_a_different_model_shape_is_refused(tmp_path, capsys):
    assert main(_args(tmp_path, "--train.steps", "2")) == 0
    capsys.readouterr()
    assert main(_args(tmp_path, "--train.steps", "4", "--model.dim", "128",
                      "--checkpoint.resume", "latest")) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "model.dim: checkpoint 64 vs config 128" in err
    assert main(_args(tmp_path, "--checkpoint.resume", str(tmp_path / "nowhere"))) == 2
    assert "checkpoint.resume" in capsys.readouterr().err


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_nproc_2_then_torchrun_resume_then_generate(tmp_path):
    """Our launcher trains 4 steps on 2 processes; torchrun resumes to 8; generate samples."""
    common = ["--config", "tiny", "--train.run_dir", str(tmp_path / "run"),
              *tiny_data(tmp_path), "--train.steps", "8",
              "--checkpoint.every", "4", "--train.log_every", "1"]
    first = _run([sys.executable, "-m", "shardtrain", "train", "--nproc", "2", *common,
                  "--train.steps", "4"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "done: step 4" in first.stdout
    second = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "-m", "shardtrain", "train", *common,
                   "--checkpoint.resume", "latest"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert "done: step 8" in second.stdout
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu",
                "peak_mem_bytes", "comm_bytes"):
        assert all(key in r for r in records), key
    assert all(r["comm_bytes"] > 0 for r in records)
    assert "eval_loss" in records[-1]
    assert "[train]" in (run / "config.toml").read_text()
    for rank in (0, 1):
        ledger = json.loads((run / f"memory_rank{rank}.json").read_text())
        assert ledger["params_bytes"] > 0 and ledger["peak_mem_bytes"] > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004",
                                                                      "step_00000008"]
    sample = _run([sys.executable, "-m", "shardtrain", "generate", "--checkpoint",
                   str(run / "checkpoints" / "step_00000008"), "--prompt", "import ",
                   "--tokens", "20"], tmp_path)
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("import ") and len(sample.stdout) > len("import ")
