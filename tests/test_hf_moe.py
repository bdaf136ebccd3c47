"""Mixture-of-experts families through Hugging Face interop (issue 44 part 7): tiny random
Mixtral and Qwen3-MoE (fine-grained experts, a dense first block, q/k norms) load with the
logits of `transformers` and export to directories `transformers` loads with the same
logits; the planner counts their parameters exactly (total and active); under ep = 2 and
tp = 2 a run starts from the loaded weights (its first loss is one process's) and its
checkpoint exports to the model one process trained."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from shardtrain.config import ConfigError  # noqa: E402
from shardtrain.model.hf import load_hf  # noqa: E402

from hf_tiny import check_layouts_from_checkpoint, check_load_and_export, save_random  # noqa: E402
from parity import tiny  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
             tie_word_embeddings=False, num_experts_per_tok=2,
             rope_parameters=dict(rope_type="default", rope_theta=1e6))
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=96, num_local_experts=4)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=24,
        norm_topk_prob=True, mlp_only_layers=[0])),
}


def tiny_moe(path, family: str, **changes):
    kind, extra = FAMILIES[family]
    return save_random(path, kind(**{**SHAPE, **extra, **changes}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_both_ways_and_exact_counts(tmp_path, family):
    cfg = check_load_and_export(tmp_path, tiny_moe(tmp_path / "hf", family))
    assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_score) == (4, 2, "softmax")
    assert (cfg.moe_first_dense, cfg.expert_hidden) == ((1, 32) if family == "qwen3_moe"
                                                         else (0, 96))


def test_refusals_and_export_rules(tmp_path):
    tiny_moe(tmp_path / "jitter", "mixtral", router_jitter_noise=0.1)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        load_hf(tmp_path / "jitter")
    tiny_moe(tmp_path / "plain", "qwen3_moe", norm_topk_prob=False)
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        load_hf(tmp_path / "plain")
    tiny_moe(tmp_path / "sparse", "qwen3_moe", mlp_only_layers=[1])
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        load_hf(tmp_path / "sparse")
    with pytest.raises(ConfigError, match="train.export_hf.*shared experts"):
        tiny(tmp_path, "x", "--model.n_experts", "4", "--model.moe_shared_experts", "1",
             "--train.export_hf", str(tmp_path / "o")).validate(1)


@pytest.mark.slow  # one 2-rank spawn of two runs and their exports (~40 s)
def test_ep2_and_tp2_start_from_the_checkpoint_and_export(tmp_path):
    """Qwen3-MoE loaded under ep=2 and under tp=2 (sp) trains as one process does from the
    same weights (losses rtol 1e-5), and each run's last checkpoint exports (streamed,
    `shardtrain export`) to a directory transformers loads with one process's logits."""
    tiny_moe(tmp_path / "hf", "qwen3_moe", max_position_embeddings=64)  # the tiny preset's
    common = ("--model.init_from", str(tmp_path / "hf"), "--train.steps", "2",
              "--train.seq_len", "24", "--model.moe_z_loss_coef", "0",
              "--checkpoint.every", "2")
    check_layouts_from_checkpoint(tmp_path, "qwen3_moe", *common)
