"""Hugging Face interop: tiny `transformers` models (random weights, built from a config,
saved with save_pretrained) load into shardtrain with equal logits, and shardtrain's
export loads back into `transformers` with equal logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardtrain.config import ConfigError  # noqa: E402
from shardtrain.model.hf import hf_tokenizer, load_hf, save_hf, source_config  # noqa: E402

TOKENS = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))


def tiny_llama(tmp_path, *, tied=False, shard="1GB"):
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, max_shard_size=shard)
    return model


def tiny_gpt2(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=64, layer_norm_epsilon=1e-5)
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # biases and LayerNorms away from their zero/one init
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if "bias" in name else 1.0, 0.1)
    model.save_pretrained(tmp_path)
    return model


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def ours_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.parametrize("tied,shard", [(False, "20KB"), (True, "1GB")])
def test_llama_logits_match_both_ways(tmp_path, tied, shard):
    ref = tiny_llama(tmp_path / "hf", tied=tied, shard=shard)
    if shard == "20KB":
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.n_kv_heads == 2 and ours.cfg.rope_theta == 5000.0
    assert ours.cfg.norm_eps == 1e-6 and ours.cfg.tie_embeddings == tied
    torch.testing.assert_close(ours_logits(ours), hf_logits(ref), rtol=0, atol=1e-5)
    # Out again (sharded to exercise the index), and into transformers.
    save_hf(ours, tmp_path / "out", max_shard_bytes=30_000,
            base_config=source_config(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(ref), rtol=0, atol=1e-5)
    mask = os.umask(0)
    os.umask(mask)
    for f in (tmp_path / "out").glob("*.safetensors"):  # the mode open() gives, not 0600
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f


def test_gpt2_logits_match_both_ways(tmp_path):
    ref = tiny_gpt2(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.style == "gpt2" and ours.cfg.tie_embeddings
    torch.testing.assert_close(ours_logits(ours), hf_logits(ref), rtol=0, atol=1e-5)
    save_hf(ours, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(ref), rtol=0, atol=1e-5)


def test_tokenizer_json_is_found_and_copied(tmp_path):
    from tokenizers import Tokenizer, models

    tiny_gpt2(tmp_path / "hf")
    assert hf_tokenizer(tmp_path / "hf") is None
    Tokenizer(models.BPE()).save(str(tmp_path / "hf" / "tokenizer.json"))
    assert hf_tokenizer(tmp_path / "hf") == tmp_path / "hf" / "tokenizer.json"
    save_hf(load_hf(tmp_path / "hf"), tmp_path / "out", tokenizer_file=hf_tokenizer(tmp_path / "hf"))
    assert hf_tokenizer(tmp_path / "out") is not None


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_bad_directories_name_the_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        load_hf(tmp_path / "nowhere")
    tiny_llama(tmp_path / "hf")
    hf = tmp_path / "hf"
    (hf / "config.json").rename(hf / "saved.json")
    with pytest.raises(ConfigError, match=r"config.json: missing"):
        load_hf(hf)
    (hf / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: malformed JSON"):
        load_hf(hf)
    (hf / "saved.json").rename(hf / "config.json")
    _edit_config(hf, model_type="bert")
    with pytest.raises(ConfigError, match=r"config.json: model_type='bert' is not supported"):
        load_hf(hf)
    _edit_config(hf, model_type="llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(ConfigError, match="rope_type='longrope' is not supported"):
        load_hf(hf)
    _edit_config(hf, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                 hidden_size="64")
    with pytest.raises(ConfigError, match=r"field 'hidden_size'='64' must be a int"):
        load_hf(hf)
    _edit_config(hf, hidden_size=64, intermediate_size=128)
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj"
                                          r".weight' has shape .*96.*, but .*config.json implies"):
        load_hf(hf)
    _edit_config(hf, intermediate_size=96, num_hidden_layers=3)
    with pytest.raises(ConfigError, match=r"lack 9 tensor\(s\)"):
        load_hf(hf)
