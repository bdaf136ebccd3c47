"""DeepSeek-V3 through Hugging Face interop (issue 44 part 7): tiny random transformers
`deepseek_v3` models (latent attention with and without the q bottleneck; sigmoid routing
with the router's e_score_correction_bias, a shared expert, a dense first block, group-
limited routing and routed_scaling_factor; and an all-dense one) load with the logits of
`transformers` and export to directories `transformers` loads with the same logits; the
planner counts their parameters exactly (total and active); the multi-token-prediction
blocks of a checkpoint are skipped; under ep = 2 and tp = 2 a run starts from the loaded
weights as one process does, and its checkpoint exports to the model one process trained."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardtrain.config import ConfigError  # noqa: E402
from shardtrain.model.hf import load_hf  # noqa: E402

from hf_tiny import (check_layouts_from_checkpoint, check_load_and_export, logits,  # noqa: E402
                     save_random)
from parity import tiny  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128,
             tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32,
             n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
             first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
             kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, rope_parameters=dict(rope_type="default", rope_theta=1e4))
VARIANTS = {"moe": {}, "no-q-bottleneck": dict(q_lora_rank=None),
            "dense": dict(first_k_dense_replace=3)}


def tiny_deepseek(path, **changes):
    """A random DeepSeek-V3 saved to `path` (save_random: 1-D weights moved off their
    init), its expert biases away from zero too (a missed or misplaced one changes the
    choice of experts)."""
    model = save_random(path, transformers.DeepseekV3Config(**{**SHAPE, **changes}))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_both_ways_and_exact_counts(tmp_path, variant):
    cfg = check_load_and_export(tmp_path, tiny_deepseek(tmp_path / "hf", **VARIANTS[variant]))
    assert (cfg.attention, cfg.kv_lora_rank, cfg.v_head_dim) == ("mla", 32, 12)
    if variant != "dense":
        assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_score, cfg.moe_balance) == \
            (8, 3, "sigmoid", "bias")
        assert (cfg.moe_groups, cfg.moe_max_groups, cfg.moe_route_scale) == (4, 2, 2.5)


def test_mtp_blocks_skipped_and_refusals(tmp_path):
    """A checkpoint's blocks after the last (DeepSeek-V3's MTP modules) are skipped;
    what shardtrain does not run is refused with the field named."""
    tiny_deepseek(tmp_path / "hf", first_k_dense_replace=3)
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    load_hf(tmp_path / "hf")
    for changes, field in ((dict(rope_interleave=False), "rope_interleave"),
                           (dict(num_experts_per_tok=1), "num_experts_per_tok"),
                           (dict(n_shared_experts=0), "n_shared_experts")):
        tiny_deepseek(tmp_path / field, **changes)
        with pytest.raises(ConfigError, match=field):
            load_hf(tmp_path / field)
    with pytest.raises(ConfigError, match="train.export_hf.*softmax scores"):
        tiny(tmp_path, "x", "--model.attention", "mla", "--model.n_kv_heads", "0",
             "--model.kv_lora_rank", "16", "--model.qk_rope_head_dim", "8",
             "--model.v_head_dim", "8", "--model.n_experts", "4",
             "--model.moe_shared_experts", "1", "--train.export_hf", str(tmp_path / "o")
             ).validate(1)


@pytest.mark.slow  # one 2-rank spawn of two runs and their exports (~30 s)
def test_ep2_and_tp2_start_from_the_checkpoint_and_export(tmp_path):
    """DeepSeek-V3 loaded under ep=2 and under tp=2 (sp) trains as one process does from
    the same weights and expert biases (losses rtol 1e-5), and each run's last checkpoint
    exports (streamed, `shardtrain export`) to a directory transformers loads with one
    process's logits."""
    tiny_deepseek(tmp_path / "hf", max_position_embeddings=64, num_hidden_layers=2)
    # n_kv_heads: the tiny preset's 2 dropped (latent attention has no kv heads)
    common = ("--model.init_from", str(tmp_path / "hf"), "--model.n_kv_heads", "0",
              "--train.steps", "2", "--train.seq_len", "24", "--checkpoint.every", "2")
    check_layouts_from_checkpoint(tmp_path, "deepseek_v3", *common)


def test_export_without_an_expert_bias(tmp_path):
    """A latent-attention MoE trained with moe_balance = aux exports to DeepSeek-V3 with a
    zero e_score_correction_bias, and transformers computes its logits."""
    from shardtrain.config import ModelConfig
    from shardtrain.model.hf import save_hf
    from shardtrain.model.transformer import build_model

    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64,
                      attention="mla", kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, n_experts=4, moe_top_k=2,
                      moe_score="sigmoid", moe_shared_experts=1, moe_ffn_dim=32)
    cfg.validate()
    ours = build_model(cfg, seed=2).eval()
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not back.model.layers[0].mlp.gate.e_score_correction_bias.any()
    torch.testing.assert_close(logits(back, False), logits(ours, True), rtol=0, atol=1e-4)
