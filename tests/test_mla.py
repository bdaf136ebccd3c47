"""Multi-head latent attention (model.attention = mla, issue 44 part 6): the math equals
transformers' DeepseekV3Attention, the planner's counts equal the built model's, packed
documents stay apart, and the config refuses what MLA does not take."""

from __future__ import annotations

import pytest
import torch

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.cost.counts import (forward_flops_per_token, matmul_params_per_token,
                                    param_counts)
from shardtrain.model.positions import rope_tables
from shardtrain.model.transformer import build_model

MLA = dict(style="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64,
           attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12)


def mla(**changes) -> ModelConfig:
    cfg = ModelConfig(**{**MLA, **changes})
    cfg.validate()
    return cfg


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_attention_equals_transformers_deepseek_v3(q_lora_rank):
    """Our LatentAttention with transformers' weights (interleaved RoPE pairs, its default
    rope_interleave, are ours: no permutation) gives DeepseekV3Attention's output."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = mla(q_lora_rank=q_lora_rank)
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=q_lora_rank or None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=64, rope_parameters=dict(
            rope_type="default", rope_theta=cfg.rope_theta))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = ds.DeepseekV3Attention(hf_cfg, 0).eval()
    ours = build_model(cfg, seed=1).layers[0].attn.eval()
    names = {"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj", "q_a_norm": "q_a_layernorm",
             "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
             "wo": "o_proj"}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            module, leaf = name.split(".")
            src = getattr(getattr(theirs, names[module]), leaf)
            p.copy_(src + (0.3 * torch.randn_like(src) if "norm" in module else 0))
            src.copy_(p)
    x = torch.randn(2, 10, 64)
    rotary = ds.DeepseekV3RotaryEmbedding(hf_cfg)
    positions = torch.arange(10)[None].expand(2, -1)
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    want = theirs(x, rotary(x, positions), mask)[0]
    cos, sin = rope_tables(cfg)
    got = ours(x, (cos[:10], sin[:10]))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": 24}, {"n_experts": 4,
                                     "moe_shared_experts": 1, "moe_first_dense": 1}])
def test_counts_equal_the_built_model(changes):
    cfg = mla(**changes)
    model = build_model(cfg, seed=None)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if n.rpartition(".")[2] in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    mha = ModelConfig(**{k: v for k, v in {**MLA, **changes}.items() if k not in (
        "attention", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "q_lora_rank")})
    other = matmul_params_per_token(mha) - 4 * 64 * 64 * mha.n_layers  # the MLPs, the head
    assert matmul_params_per_token(cfg) == linears + other
    # scores over D = 24 channels, values of 12, per head and key: 2 s H (24 + 12)
    assert forward_flops_per_token(cfg, 32) - 2 * matmul_params_per_token(cfg) == \
        2 * 2 * 32 * 4 * (24 + 12)


def test_documents_attend_apart_and_every_weight_learns():
    """Two packed documents give each one's logits alone (RoPE positions restart), and a
    backward reaches every parameter."""
    model = build_model(mla(q_lora_rank=24), seed=2)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    packed = model(tokens, positions)
    torch.testing.assert_close(packed[:, :12], model(tokens[:, :12]), rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 12:], model(tokens[:, 12:]), rtol=0, atol=1e-5)
    packed.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("changes,field", [
    ({"kv_lora_rank": 0}, "kv_lora_rank"), ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"v_head_dim": 40}, "v_head_dim"), ({"n_kv_heads": 2}, "n_kv_heads"),
    ({"qk_norm": True}, "qk_norm"), ({"attention": "mha"}, "kv_lora_rank"),
    ({"attention": "gqa"}, "attention"), ({"moe_route_scale": 0.0}, "moe_route_scale")])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        mla(**changes)


def test_fp8_checks_the_latent_widths():
    """train.fp8 needs every linear's widths multiples of 16: under mla the latent ones."""
    pytest.importorskip("torchao")
    from shardtrain import config

    shape = ["--model.attention", "mla", "--model.n_kv_heads", "0", "--model.kv_lora_rank",
             "32", "--model.qk_nope_head_dim", "16", "--model.v_head_dim", "16",
             "--train.fp8", "tensorwise", "--train.precision", "bf16"]
    config.load("tiny", [*shape, "--model.qk_rope_head_dim", "16"]).validate(1)
    with pytest.raises(ConfigError, match="kv_lora_rank \\+ qk_rope_head_dim = 40"):
        config.load("tiny", [*shape, "--model.qk_rope_head_dim", "8"]).validate(1)
    # under tp each rank holds its heads' part of the latents' output gradient
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.attention=mla"):
        config.load("tiny", [*shape, "--model.qk_rope_head_dim", "16", "--parallel.tp",
                             "2"]).validate(2)


def test_deepseek_v3_counts_are_the_published_ones():
    """DeepSeek-V3's shape (its config.json, MTP module aside): 671B parameters, 37B of
    them active per token (arXiv 2412.19437, abstract)."""
    cfg = ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, ffn_dim=18432,
                      max_seq_len=4096, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      n_experts=256, moe_top_k=8, moe_ffn_dim=2048, moe_shared_experts=1,
                      moe_first_dense=3, moe_score="sigmoid", moe_balance="bias",
                      moe_groups=8, moe_max_groups=4, moe_route_scale=2.5)
    cfg.validate()
    counts = param_counts(cfg)
    assert (counts.total // 10**9, counts.active // 10**9) == (671, 37)
