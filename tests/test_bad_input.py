"""Bad input costs nothing (issue 34): every bad value is refused before launch with exit 2
and a message naming the field (or file) and the fix, and a refused run leaves no run dir
behind, nor changes an existing one. One test per class: non-finite values, ranges,
--nproc, a preset's value that conflicts with a model directory, files that are not what
they claim (data, checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity import tiny_data
from shardtrain import config
from shardtrain.cli import main
from shardtrain.config import ConfigError


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", "tiny", "--train.run_dir", str(tmp / "run"),
            *tiny_data(tmp), *extra]


def _refused(capsys, tmp: Path, argv: list[str], *needles: str) -> str:
    """Exit 2, one `shardtrain train: error:` line holding every needle, no run dir."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardtrain train: error:") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert not (tmp / "run").exists(), "a refused run left its run dir behind"
    return err


@pytest.mark.parametrize("field", [
    "train.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps",
    "optim.grad_clip", "loss_scale.initial", "loss_scale.min_scale", "comm.bucket_mb",
    "model.norm_eps", "train.straggler_factor", "parallel.ps_partition_mb"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_values_are_refused(tmp_path, capsys, field, value):
    _refused(capsys, tmp_path, _args(tmp_path, f"--{field}", value),
             f"{field}='{value}' is not a finite number")


def test_non_finite_in_a_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlr = nan\n")
    _refused(capsys, tmp_path, ["train", "--config", str(path), "--train.run_dir",
                                str(tmp_path / "run")], str(path), "train.lr=nan")


def test_non_finite_set_in_code_is_refused():
    cfg = config.load("tiny")
    cfg.optim.weight_decay = float("nan")
    with pytest.raises(ConfigError, match="optim.weight_decay=nan is not a finite number"):
        cfg.validate(1)


@pytest.mark.parametrize("extra, needle", [
    (["--optim.beta1", "1.0"], "optim.beta1=1.0 must be in [0, 1)"),
    (["--optim.beta2", "-0.1"], "optim.beta2=-0.1 must be in [0, 1)"),
    (["--optim.eps", "0"], "optim.eps=0.0 must be > 0"),
    (["--optim.weight_decay", "-1"], "optim.weight_decay=-1.0 must be >= 0"),
    (["--optim.momentum", "1.5"], "optim.momentum=1.5 must be in [0, 1)"),
    (["--model.norm_eps", "0"], "model.norm_eps=0.0 must be > 0"),
    (["--train.eval_every", "-1"], "train.eval_every=-1 must be >= 0"),
    (["--train.sample_tokens", "-5"], "train.sample_tokens=-5 must be >= 0"),
    (["--train.lr", "0"], "train.lr=0.0 must be positive"),
    (["--train.steps", "0"], "train.steps=0 must be positive"),
    (["--checkpoint.keep", "0"], "checkpoint.keep >= 1"),
    (["--loss_scale.hysteresis", "0"], "loss_scale.hysteresis=0 must be positive"),
    (["--nproc", "0"], "--nproc 0 must be >= 1"),
    (["--nproc", "-2"], "--nproc -2 must be >= 1"),
])
def test_out_of_range_values_are_refused(tmp_path, capsys, extra, needle):
    _refused(capsys, tmp_path, _args(tmp_path, *extra), needle)


def test_a_presets_conflict_with_a_model_directory_names_the_preset(tmp_path, capsys):
    """The tiny preset sets model.max_seq_len=64; a model directory says 128. The user never
    typed 64: the message says where it came from and how to override it."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}))
    _refused(capsys, tmp_path, _args(tmp_path, "--model.init_from", str(hf)),
             "model.max_seq_len=64 conflicts with", "came from preset 'tiny'",
             "override it with --model.max_seq_len VALUE")


def test_rejected_inputs_leave_no_run_dir(tmp_path, capsys):
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"text": broken\n')
    _refused(capsys, tmp_path, _args(tmp_path, "--data.source", str(bad_jsonl)), str(bad_jsonl))
    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    _refused(capsys, tmp_path, _args(tmp_path, "--checkpoint.resume", str(not_ckpt)),
             "checkpoint.resume")
    _refused(capsys, tmp_path, _args(tmp_path, "--checkpoint.resume", "latest"),
             "checkpoint.resume=latest: no checkpoint")


def test_restarts_need_an_older_checkpoint_kept(tmp_path, capsys):
    _refused(capsys, tmp_path, _args(tmp_path, "--max-restarts", "1", "--checkpoint.keep", "1"),
             "--max-restarts 1 needs checkpoint.keep >= 2 (it is 1)")


def test_a_corrupt_or_truncated_checkpoint_is_refused_and_an_existing_run_dir_untouched(tmp_path, capsys):
    first = tmp_path / "first"
    assert main(_args(tmp_path, "--train.steps", "2", "--train.run_dir", str(first))) == 0
    capsys.readouterr()
    step = first / "checkpoints" / "step_00000002"
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # corrupt, same size: found by its checksum when read
    shard.write_bytes(bytes(data))
    _refused(capsys, tmp_path, _args(tmp_path, "--checkpoint.resume", str(step)),
             str(shard), "checksum")
    shard.write_bytes(bytes(data[:-100]))  # truncated: found before launch
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    _refused(capsys, tmp_path, _args(tmp_path, "--checkpoint.resume", str(step)),
             str(shard), "incomplete")
    # The same refusal with the existing run dir as the target: nothing in it changes.
    assert main(_args(tmp_path, "--train.run_dir", str(first), "--train.lr", "nan")) == 2
    assert main(_args(tmp_path, "--train.run_dir", str(first), "--checkpoint.resume",
                      "latest", "--train.steps", "4")) == 2
    capsys.readouterr()
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before
