"""LoRA adapters in peft's format: shardtrain's `export --adapters-only` loads in
`peft.PeftModel.from_pretrained` with the logits of shardtrain's merged export, and an
adapter peft trained and saved loads into shardtrain (`lora.init_from`) with peft's
logits and continues training."""

from __future__ import annotations

import json

import pytest
import torch

from parity import make_mesh, tiny
from shardtrain.config import ConfigError
from shardtrain.train.finetune.finetune import build_start_model, export_hf, resolve_init_from, save_adapters
from shardtrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_base(path, kind: str = "llama"):
    """A random tiny base with the tiny preset's shape (Qwen2: biases, so B's permuted rows
    meet permuted bias rows), saved."""
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config(**shape))
    model.save_pretrained(path)
    return path


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_our_adapters_load_in_peft_equal_to_our_merged_export(tmp_path, kind):
    base = hf_base(tmp_path / "hf", kind)
    cfg = tiny(tmp_path, "run", "--model.init_from", str(base), "--lora.rank", "4",
               "--lora.alpha", "8", "--lora.targets", "q,k,v,o,gate,up,down")
    resolve_init_from(cfg)
    model = build_start_model(cfg)
    with torch.no_grad():  # trained adapters: B away from zero
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    export_hf(model, cfg, tmp_path / "merged")
    save_adapters(model, cfg, tmp_path / "adapters")
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    plain = logits(reloaded)  # before peft wraps the model in place
    adapted = peft.PeftModel.from_pretrained(reloaded, tmp_path / "adapters").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(adapted), logits(merged), rtol=0, atol=1e-4)
    torch.testing.assert_close(logits(adapted), logits(model), rtol=0, atol=1e-4)
    assert (logits(adapted) - plain).abs().max() > 1e-2  # the adapters act


def test_peft_adapter_loads_and_continues_training(tmp_path):
    base = hf_base(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                               "down_proj"], task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, lora)
    optim = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    adapted(TOKENS, labels=TOKENS).loss.backward()  # one step: B leaves zero
    optim.step()
    adapted.save_pretrained(tmp_path / "peft")
    adapted.eval()
    cfg = tiny(tmp_path, "continue", "--model.init_from", str(base), "--lora.init_from",
               str(tmp_path / "peft"), "--train.steps", "3", "--train.global_batch", "4",
               "--train.lr", "1e-2")
    resolve_init_from(cfg)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (4, 16.0, "q,k,v,down")
    torch.testing.assert_close(logits(build_start_model(cfg)), logits(adapted), rtol=0,
                               atol=1e-4)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    model = trainer.parallel.module  # one process: the whole model, built by the layout
    torch.testing.assert_close(logits(model), logits(adapted), rtol=0, atol=1e-4)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = trainer.run()
    assert len(result.losses) == 3 and all(x == x for x in result.losses)
    after = dict(model.named_parameters())
    moved = [n for n in start if not torch.equal(start[n], after[n].detach())]
    assert moved and all("lora_" in n for n in moved)  # the adapters train, the base stays
    # An adapter peft cannot describe plainly is refused, naming the field.
    raw = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(ConfigError, match=r"use_dora=True is not supported .*use_dora=False"):
        resolve_init_from(tiny(tmp_path, "bad", "--model.init_from", str(base),
                               "--lora.init_from", str(tmp_path / "peft")))
