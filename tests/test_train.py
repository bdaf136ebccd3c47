"""The single-process trainer: schedule, precision, activation checkpointing, optimizers,
checkpoint rotation, and a BPE-tokenized run."""

import math
import shutil

import pytest
import torch

from parity import assert_parity, tiny, train_layout
from shardtrain import config
from shardtrain.cli import main
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.optim import lr_at
from shardtrain.train.trainer import Trainer


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, base_lr=1.0, warmup=10, total=100, min_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(100, base_lr=1.0, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)


def _run(cfg):
    trainer = Trainer(cfg, build_mesh(MeshShape()), torch.device("cpu"))
    return trainer, trainer.run()


def test_activation_checkpointing_changes_no_numbers(tmp_path):
    plain = train_layout(0, 1, config.to_toml(tiny(tmp_path, "plain", "--train.steps", "4")))
    full = train_layout(0, 1, config.to_toml(tiny(tmp_path, "ac", "--train.steps", "4",
                                                  "--train.activation_checkpointing", "full")))
    assert_parity(plain, full, "activation checkpointing")


@pytest.mark.parametrize("overrides", [
    ["--train.precision", "bf16"],
    ["--optim.name", "sgd", "--train.lr", "0.05"],
    ["--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true"],
    ["--model.n_experts", "4", "--model.moe_top_k", "2"],
], ids=["bf16", "sgd", "gpt2-tied", "moe"])
def test_variants_learn(tmp_path, overrides):
    _, result = _run(tiny(tmp_path, "v", "--train.steps", "12", "--train.lr", "3e-3", *overrides))
    losses = result.losses
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses


def test_checkpoints_rotate_and_are_atomic(tmp_path):
    trainer, _ = _run(tiny(tmp_path, "rot", "--train.steps", "6", "--checkpoint.every", "2",
                           "--checkpoint.keep", "2"))
    ckpts = sorted(p.name for p in (tmp_path / "rot" / "checkpoints").iterdir())
    assert ckpts == ["step_00000004", "step_00000006"]  # no leftover temporary directories


def test_bpe_tokenized_run(tmp_path, capsys):
    cfg = tiny(tmp_path, "bpe", "--train.steps", "3", "--data.tokenizer", "bpe",
               "--data.bpe_vocab_size", "512", "--model.vocab_size", "512",
               "--data.max_bytes", "300000", "--data.cache_dir", str(tmp_path / "cache"))
    trainer, result = _run(cfg)
    assert trainer.data.tokenizer.vocab_size <= 512 and len(result.losses) == 3
    assert trainer.sample("def ", 5).startswith("def")
    # The checkpoint carries the tokenizer: generate works with the token cache gone.
    shutil.rmtree(tmp_path / "cache")
    step = tmp_path / "bpe" / "checkpoints" / "step_00000003"
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(step), "--prompt", "def ", "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def")
