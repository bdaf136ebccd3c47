"""Shared and fine-grained experts and dense first blocks (issue 44 part 2, docs/moe.md):
the model's structure and numbers, the config's errors, the planner's exact counts, and
(slow) parity under every layout that splits an MoE model."""

from __future__ import annotations

import pytest
import torch

from shardtrain import config
from shardtrain.config import ConfigError, ModelConfig
from shardtrain.cost.counts import matmul_params_per_token, param_counts
from shardtrain.model.mlp import MLP
from shardtrain.model.moe import MoE
from shardtrain.model.transformer import build_model

from moe_parity import check_moe_layouts
from parity import tiny

DEEPSEEK = ("--model.n_experts", "4", "--model.moe_ffn_dim", "32", "--model.moe_shared_experts",
            "1", "--model.moe_first_dense", "1", "--model.moe_score", "sigmoid",
            "--model.moe_balance", "bias", "--model.moe_aux_loss_coef", "0.001",
            "--model.moe_groups", "2", "--model.moe_max_groups", "1")
SHAPES = [dict(n_experts=8, moe_ffn_dim=48, moe_shared_experts=2, moe_first_dense=1),
          dict(n_experts=4, moe_first_dense=2, n_layers=3),
          dict(n_experts=4, moe_shared_experts=1, style="gpt2"),
          dict(n_experts=6, moe_top_k=3, moe_ffn_dim=16)]


def _cfg(**shape) -> ModelConfig:
    base = dict(dim=64, n_layers=3, n_heads=4, max_seq_len=32)
    return ModelConfig(**{**base, **shape})


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_structure_and_exact_counts(shape):
    """Blocks below moe_first_dense are dense MLPs of ffn_dim, the rest MoE blocks whose
    experts are moe_ffn_dim wide with one shared MLP of moe_shared_experts x that width;
    the planner's total, active and per-token matmul counts equal the built model's."""
    cfg = _cfg(**shape)
    cfg.validate()
    model = build_model(cfg, seed=0)
    for i, block in enumerate(model.layers):
        assert isinstance(block.mlp, MoE) == (i >= cfg.moe_first_dense), i
        if isinstance(block.mlp, MoE):
            assert block.mlp.experts.w1.shape[1] == cfg.expert_hidden
            shared = block.mlp.shared
            assert (shared is None) == (not cfg.moe_shared_experts)
            if shared is not None:
                assert shared.w1.out_features == cfg.moe_shared_experts * cfg.expert_hidden
        else:
            assert block.mlp.w1.out_features == cfg.ffn_hidden
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    # active: every parameter but the experts a token does not route to
    idle = sum(p.numel() * (1 - cfg.moe_top_k / cfg.n_experts)
               for n, p in model.named_parameters() if ".experts." in n)
    assert counts.active == counts.total - idle
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "head")  # router included
    routed = sum(p.numel() * cfg.moe_top_k / cfg.n_experts
                 for n, p in model.named_parameters() if n.endswith(("experts.w1", "experts.w2",
                                                                      "experts.w3")))
    assert matmul_params_per_token(cfg) == linears + routed + cfg.vocab_size * cfg.dim


def test_shared_experts_add_a_dense_mlp():
    """A MoE block with shared experts returns the routed output plus its shared MLP's."""
    cfg = _cfg(n_experts=4, moe_shared_experts=2, moe_ffn_dim=16)
    torch.manual_seed(0)
    block = MoE(cfg, layer=0).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, cfg.dim)
    with_shared = block(x)
    shared, block.shared = block.shared, None
    assert isinstance(shared, MLP)
    torch.testing.assert_close(with_shared, block(x) + shared(x))


@pytest.mark.parametrize("overrides,field", [
    (dict(moe_shared_experts=1), "model.moe_shared_experts"),
    (dict(moe_ffn_dim=32), "model.moe_ffn_dim"),
    (dict(n_experts=4, moe_first_dense=3), "model.moe_first_dense"),
    (dict(n_experts=4, moe_ffn_dim=-8), "model.moe_ffn_dim"),
    (dict(n_experts=4, moe_ffn_dim=20), "model.moe_ffn_dim"),  # grouped matmul: multiples of 8
])
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _cfg(**overrides).validate()


def test_resume_refuses_other_experts(tmp_path):
    """The expert shapes are the saved tensors' (checkpoint.MODEL_STATE_FIELDS)."""
    from shardtrain.train.checkpoint.checkpoint import MODEL_STATE_FIELDS
    assert {"moe_ffn_dim", "moe_shared_experts", "moe_first_dense"} <= set(MODEL_STATE_FIELDS)


def _expert_bias(trainer) -> dict:
    return {"bias": {k: v for k, v in trainer.parallel.full_state_dict().items()
                     if k.endswith("expert_bias")}}


@pytest.mark.slow  # a 2-rank spawn of seven rows, a 4-rank one of two (~60 s loaded)
def test_deepseek_shaped_parity(tmp_path):
    """A DeepSeek-shaped model (block 0 dense, block 1 fine-grained experts with a shared
    one, sigmoid routing limited to one of two groups, with the expert bias) trains as one
    process does under ep=2 (the grouped exchange), tp=2 with sp, pp=2 (a dense stage and a
    MoE stage), cp=2, dp=2 x ZeRO-3 and ep=2 x dp=2 x ZeRO-2 (fp32: losses, weights, the
    biases bitwise), and under ep=2, pp=2 and ep=2 x dp=2 x ZeRO-2 in bf16."""
    text = lambda name, *o: config.to_toml(  # noqa: E731
        tiny(tmp_path, name, *DEEPSEEK, "--train.steps", "4", *o))
    check_moe_layouts(text, _expert_bias, tp=("--parallel.tp", "2", "--parallel.sp", "true"))
