"""A run dir holds one run's checkpoints (train/checkpoint/rundir.py, issue 39): a fresh run
into a dir with checkpoints is refused before anything is written, `--train.overwrite true`
moves the earlier run aside whole; the keep-newest rule never removes the checkpoint just
committed; the end-of-run export, sample and fault messages take the checkpoint this run
committed, not the highest step number in the directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity import checkpoint_tensors, make_mesh, tiny, tiny_data
from shardtrain.cli import main
from shardtrain.config import ConfigError
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.rundir import claim_run_dir, run_dir_conflict
from shardtrain.train.trainer import Trainer


def _args(run_dir: Path, tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", "tiny", "--train.run_dir", str(run_dir),
            "--train.peak_flops", "1e12", *tiny_data(tmp), *extra]


def _digest(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def _steps(run_dir: Path) -> list[int]:
    return [ckpt.read_meta(p)["step"] for p in ckpt.list_checkpoints(run_dir / "checkpoints")]


def test_a_fresh_run_into_a_used_run_dir_is_refused_or_moves_the_old_run_aside(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(run, tmp_path, "--train.steps", "4", "--checkpoint.every", "2")) == 0
    before = _digest(run)
    b = ("--train.steps", "3", "--checkpoint.every", "1", "--train.seed", "7",
         "--train.export_hf", str(tmp_path / "b-hf"))
    capsys.readouterr()
    assert main(_args(run, tmp_path, *b)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for text in (str(run / "checkpoints"), "step_00000002 .. step_00000004",
                 "--checkpoint.resume latest", "another train.run_dir",
                 "--train.overwrite true", f"{run}.old-1"):
        assert text in err, (text, err)
    assert _digest(run) == before  # nothing written
    assert not (tmp_path / "b-hf").exists()

    assert main(_args(run, tmp_path, *b, "--train.overwrite", "true")) == 0
    out = capsys.readouterr().out
    assert f"train.overwrite: moved the earlier run in {run} to {run}.old-1" in out
    assert _digest(tmp_path / "run.old-1") == before  # the earlier run, whole
    assert _steps(run) == [2, 3]
    assert [json.loads(line)["step"] for line in
            (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    exported = load_file(tmp_path / "b-hf" / "model.safetensors")["model.embed_tokens.weight"]
    mine = checkpoint_tensors(run / "checkpoints" / "step_00000003")["tok_emb.weight"]
    assert torch.equal(exported, mine)


def test_which_resumes_mix_with_a_run_dirs_checkpoints(tmp_path):
    """Pure checks on directories named like checkpoints (no training)."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (4, 8):
        (root / f"step_{step:08d}").mkdir(parents=True)
    other = tmp_path / "other" / "checkpoints" / "step_00000006"
    other.mkdir(parents=True)

    def conflict(*overrides: str) -> str:
        return run_dir_conflict(tiny(tmp_path, "run", *overrides))

    assert conflict("--checkpoint.resume", "latest") == ""
    assert conflict("--checkpoint.resume", str(root / "step_00000008")) == ""  # the newest
    assert "older than that run dir's newest checkpoint (step_00000008)" in \
        conflict("--checkpoint.resume", str(root / "step_00000004"))
    assert "resumed from" in conflict("--checkpoint.resume", str(other))
    assert "holds an earlier run's checkpoints (step_00000004 .. step_00000008)" in conflict()
    assert run_dir_conflict(tiny(tmp_path, "fresh")) == ""
    # overwrite moves the earlier run, unless this run resumes from inside it
    assert claim_run_dir(tiny(tmp_path, "run", "--train.overwrite", "true"))
    assert claim_run_dir(tiny(tmp_path, "run", "--train.overwrite", "true",
                              "--checkpoint.resume", str(other)))
    with pytest.raises(ConfigError, match="would move the checkpoint this run resumes from"):
        claim_run_dir(tiny(tmp_path, "run", "--train.overwrite", "true",
                           "--checkpoint.resume", str(root / "step_00000004")))
    with pytest.raises(ConfigError, match="--train.overwrite true"):
        claim_run_dir(tiny(tmp_path, "run"))


def test_the_run_uses_the_checkpoint_it_committed(tmp_path):
    """Two trainers into one dir (as the refusal above now prevents from the command line):
    the second's saves, numbered below the first's, are kept as they are committed, and its
    export is its own weights, not the first run's higher-numbered step 4."""
    a = tiny(tmp_path, "run", "--train.steps", "4", "--checkpoint.every", "2")
    Trainer(a, make_mesh(a, 0, 1), torch.device("cpu")).run()
    b = tiny(tmp_path, "run", "--train.steps", "3", "--checkpoint.every", "1",
             "--train.seed", "7", "--train.export_hf", str(tmp_path / "hf"))
    trainer = Trainer(b, make_mesh(b, 0, 1), torch.device("cpu"))
    trainer.run()
    mine = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert mine.is_dir()
    exported = load_file(tmp_path / "hf" / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(exported, checkpoint_tensors(mine)["tok_emb.weight"])
    assert trainer.saver.committed == mine
