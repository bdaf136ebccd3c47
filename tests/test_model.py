"""The plain model: parameter accounting, shapes, GQA/MoE/tied variants, deterministic init."""

import pytest
import torch

from shardtrain import config
from shardtrain.config import ModelConfig
from shardtrain.model.generate import generate
from shardtrain.model.transformer import build_model
from shardtrain.cost.counts import param_counts


@pytest.mark.parametrize("preset", ["tiny", "default", "gpt3-175b", "llama3-8b", "llama3-70b",
                                    "llama3-405b"])
def test_preset_param_count_equals_built_model(preset):
    cfg = config.load(preset).model
    model = build_model(cfg, seed=None)  # meta device: shapes only
    built = sum(p.numel() for p in model.parameters())
    print(f"{preset}: counted {param_counts(cfg).total:,} built {built:,}")
    assert param_counts(cfg).total == built


VARIANTS = [
    ModelConfig(style="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
    ModelConfig(style="llama", dim=64, n_layers=2, n_heads=4, tie_embeddings=True, max_seq_len=32),
    ModelConfig(style="gpt2", dim=64, n_layers=2, n_heads=4, tie_embeddings=True, max_seq_len=32),
    ModelConfig(style="gpt2", dim=64, n_layers=2, n_heads=4, max_seq_len=32),
    ModelConfig(style="llama", dim=64, n_layers=2, n_heads=4, n_experts=4, moe_top_k=2,
                max_seq_len=32),
    ModelConfig(style="gpt2", dim=64, n_layers=2, n_heads=4, n_experts=4, moe_top_k=2,
                max_seq_len=32),
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"{c.style}-tie{c.tie_embeddings}-"
                         f"kv{c.kv_heads}-e{c.n_experts}")
def test_variants_count_forward_and_backward(cfg):
    model = build_model(cfg, seed=3)
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    if cfg.n_experts:
        assert counts.active < counts.total
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    # Every module that holds parameters is called (layouts hook the calls: a parameter
    # server's pull waits there; GPT-2's position table was read without one, a race).
    called = set()
    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    for m in owners:
        m.register_forward_pre_hook(lambda m, _args: called.add(m))
    logits = model(tokens)
    assert called == set(owners)
    assert logits.shape == (2, 16, cfg.vocab_size)
    logits.sum().backward()
    # Every parameter gets a gradient (experts are stacked: an expert no token picked has
    # a zero slice).
    assert all(p.grad is not None for p in model.parameters())
    if cfg.tie_embeddings:
        assert model.head.weight is model.tok_emb.weight


def test_causal_attention_ignores_the_future():
    model = build_model(VARIANTS[0], seed=0)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


def test_init_is_deterministic_and_seeded():
    cfg = VARIANTS[0]
    a, b, c = build_model(cfg, seed=5), build_model(cfg, seed=5), build_model(cfg, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if "norm" not in name:
            assert not torch.equal(pa, pc)


def test_generate_extends_the_prompt():
    model = build_model(VARIANTS[0], seed=0)
    out = generate(model, [1, 2, 3], 5, seed=1)
    assert out[:3] == [1, 2, 3] and len(out) == 8
    assert generate(model, [1, 2, 3], 5, seed=1) == out
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(model, [], 3)
