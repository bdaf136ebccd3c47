"""metrics.jsonl across crashes (train/observe/metrics.py, issue 39): a torn last line --
what a crash during an append leaves -- is dropped on resume with one line saying so; a
bad line elsewhere stops the resume before anything starts, naming the file and line; an
append that fails is cut back, leaving no torn line."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from unittest import mock

import pytest

from parity import tiny_data
from shardtrain.cli import main
from shardtrain.config import ConfigError
from shardtrain.train.observe.metrics import MetricsWriter

TORN = '{"step": 5, "loss": 4.9'


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_torn_last_line_is_dropped_and_a_bad_middle_line_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3)]
    path.write_text("\n".join(good) + "\n" + TORN)
    MetricsWriter(tmp_path, enabled=True, resume=True, from_step=2)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"{path}: its last line (line 4) is torn" in out, out
    assert _lines(path) == good[:2]  # and the step after the checkpoint's, redone
    path.write_text("\n".join([good[0], TORN, good[2]]) + "\n")
    with pytest.raises(ConfigError, match=f"{path}:2: not a JSON record"):
        MetricsWriter(tmp_path, enabled=True, resume=True, from_step=2)


def test_a_failed_append_leaves_no_torn_line(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True, resume=False)
    writer.write({"step": 1, "loss": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real = os.write

    def half_then_full(fd, data):  # a disk that fills in the middle of the record
        real(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with mock.patch("os.write", half_then_full), \
            pytest.raises(OSError, match="No space left"):
        writer.write({"step": 2, "loss": 0.5}, {"step": 3, "loss": 0.25})
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    writer.write({"step": 2, "loss": 0.5})
    assert [json.loads(line)["step"] for line in _lines(tmp_path / "metrics.jsonl")] == [1, 2]


def test_resume_after_a_torn_append(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--train.run_dir", str(run), "--checkpoint.every",
            "2", "--train.log_every", "1", "--train.peak_flops", "1e12", *tiny_data(tmp_path)]
    assert main([*args, "--train.steps", "2"]) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write(TORN)  # a crash in the middle of step 3's append
    capsys.readouterr()
    assert main([*args, "--train.steps", "3", "--checkpoint.resume", "latest"]) == 0
    assert "is torn, as a crash during an append leaves it; dropped" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in _lines(run / "metrics.jsonl")] == [1, 2, 3]
    lines = _lines(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert main([*args, "--train.steps", "4", "--checkpoint.resume", "latest"]) == 2
    assert f"{run / 'metrics.jsonl'}:2: not a JSON record" in capsys.readouterr().err
