"""LoRA and QLoRA (train/finetune/lora.py, quant/nf4.py): step 0 equals the base model, only the
adapters train, merge/unmerge agree, exports load in transformers, NF4 matches the paper."""

from __future__ import annotations

import pytest
import torch

from shardtrain.config import Config, ConfigError
from shardtrain.config.lora import LoRAConfig
from shardtrain.model.transformer import build_model
from shardtrain.train.finetune import lora as lora_mod
from shardtrain.train.finetune.finetune import (build_start_model, export_hf, resolve_init_from,
                                       save_adapters)
from shardtrain.quant.nf4 import NF4Weight, nf4_levels

# Appendix E of Dettmers et al. 2023 (QLoRA), as published.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def small_cfg(**lora) -> Config:
    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 64, 2, 4, 2
    cfg.model.max_seq_len = 64
    cfg.lora = LoRAConfig(rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down", **lora)
    return cfg


def train_adapters(model, steps=5, lr=1e-2):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr)
    for _ in range(steps):
        logits = model(TOKENS[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_lora_starts_at_base_trains_adapters_only_and_merges():
    cfg = small_cfg()
    base = build_model(cfg.model, seed=cfg.train.seed)
    model = build_start_model(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), base(TOKENS), rtol=0, atol=0)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.endswith((".lora_a", ".lora_b")) for n in names)
    assert len(names) == 2 * 7 * cfg.model.n_layers
    a = model.layers[0].attn.wq.lora_a.detach()
    bound = 1 / cfg.model.dim ** 0.5  # Kaiming-uniform with a = sqrt(5), as peft draws A
    assert a.abs().max() <= bound and a.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.1)
    assert (model.layers[0].attn.wq.lora_b == 0).all()
    train_adapters(model)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in names)
    assert model.layers[0].attn.wq.lora_b.abs().sum() > 0
    with torch.no_grad():
        unmerged = model(TOKENS)
        assert not torch.allclose(unmerged, base(TOKENS), atol=1e-3)
        lora_mod.merge(model)
        torch.testing.assert_close(model(TOKENS), unmerged, rtol=0, atol=1e-5)
        lora_mod.unmerge(model)
        torch.testing.assert_close(model(TOKENS), unmerged, rtol=0, atol=1e-5)


def test_lora_errors_name_the_field():
    with pytest.raises(ConfigError, match="lora.targets='q,x': 'x' is not a target"):
        LoRAConfig(rank=4, targets="q,x").validate()
    with pytest.raises(ConfigError, match="lora.quantize_base=nf4 .* set lora.rank > 0"):
        LoRAConfig(quantize_base="nf4").validate()
    cfg = small_cfg()
    cfg.model.style, cfg.model.n_kv_heads = "gpt2", 0
    with pytest.raises(ConfigError, match="lora.targets includes 'up', but this model has no "
                                          "mlp.w3 linear"):
        build_start_model(cfg)
    cfg = small_cfg(quantize_base="nf4")
    cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 40, 4, 2, 0
    with pytest.raises(ConfigError, match=r"quantize_base=nf4: layers.0.attn.w\w.* not a "
                                          "multiple of the NF4 block"):
        build_start_model(cfg)


def test_nf4_levels_error_and_storage():
    torch.testing.assert_close(nf4_levels(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=2e-7)
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    q = NF4Weight(w.shape)
    q.quantize_(w)
    mae = (q.dequantize() - w).abs().mean().item()
    per_param = q.nbytes() / w.numel()
    print(f"NF4 (block 64, double-quantized scales): N(0,1) round-trip MAE {mae:.4f}, "
          f"storage {per_param:.4f} bytes/param")
    assert mae <= 0.073
    assert per_param <= 0.52


def hf_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return transformers, model


def test_lora_from_hf_exports_merged_and_adapters(tmp_path):
    transformers, ref = hf_llama(tmp_path / "hf")
    cfg = small_cfg()
    cfg.model = type(cfg.model)(init_from=str(tmp_path / "hf"))
    resolve_init_from(cfg)
    assert cfg.model.ffn_dim == 128 and cfg.model.n_kv_heads == 2
    model = build_start_model(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), ref(TOKENS).logits, rtol=0, atol=1e-5)
    train_adapters(model)
    export_hf(model, cfg, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, model(TOKENS), rtol=0, atol=1e-5)
    save_adapters(model, cfg, tmp_path / "adapters")  # peft's format (tests/test_peft.py)
    cfg.lora.init_from = str(tmp_path / "adapters")
    fresh = build_start_model(cfg)
    with torch.no_grad():
        torch.testing.assert_close(fresh(TOKENS), model(TOKENS), rtol=0, atol=0)
    cfg.model.dim = 128
    with pytest.raises(ConfigError, match=r"model.dim=128 conflicts with .*config.json \(64\)"):
        resolve_init_from(cfg)


def test_qlora_loads_quantized_and_fine_tunes(tmp_path):
    _, ref = hf_llama(tmp_path / "hf")
    cfg = small_cfg(quantize_base="nf4")
    cfg.model = type(cfg.model)(init_from=str(tmp_path / "hf"))
    resolve_init_from(cfg)
    model = build_start_model(cfg)
    wq = model.layers[0].attn.wq
    assert wq.weight is None and wq.nf4.packed.dtype == torch.uint8
    dense_bytes = sum(m.nf4.numel() * 4 for m in lora_mod.lora_modules(model).values())
    nf4_bytes = sum(m.nf4.nbytes() for m in lora_mod.lora_modules(model).values())
    assert nf4_bytes / dense_bytes * 4 <= 0.52
    with torch.no_grad():  # the NF4 base is close to, not equal to, the dense one
        err = (model(TOKENS) - ref(TOKENS).logits).abs().max().item()
    assert 0 < err < 0.5
    def loss() -> float:
        with torch.no_grad():
            logits = model(TOKENS[:, :-1]).flatten(0, 1)
            return torch.nn.functional.cross_entropy(logits, TOKENS[:, 1:].flatten()).item()

    before = loss()
    train_adapters(model, steps=15, lr=3e-2)
    assert loss() < before - 0.3  # the adapters fit the batch over a frozen NF4 base
    assert all(p.grad is None for n, p in model.named_parameters() if "lora" not in n)
