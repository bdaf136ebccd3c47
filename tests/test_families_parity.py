"""The pieces of today's Hugging Face families (model/hf_families.py) under the layouts
that touch them, against the single-process run (fp32 losses, eval loss, final weights):
q/k/v biases (Qwen2) under tp=2 with sp and under pp=2 (tied head), per-head q/k norms
with a head size other than dim / n_heads (Qwen3) under tp=2 (each rank normalises only
its heads, so their gradients are summed over tp), llama3 RoPE scaling under cp=2 ring
attention (positions of a zig-zag chunk index the scaled tables), and a Qwen3 checkpoint
loaded sharded under tp=2 with a peft adapter continued on it (each rank takes its slice
of the weights and of A or B: train/finetune/peft_format.py). One spawn."""

from __future__ import annotations

import pytest

from dist import run_distributed
from parity import assert_parity, reference_runs, tiny, train_layouts
from shardtrain import config

STEPS = "4"
QWEN2 = ("--model.qkv_bias", "true", "--model.rope_theta", "1000000",
         "--model.tie_embeddings", "true")
QWEN3 = ("--model.qk_norm", "true", "--model.head_size", "24")
# original_max_len 32 with D = 16 puts RoPE pairs in all three bands of the llama3 rule.
LLAMA3 = ("--model.rope_scaling", "llama3", "--model.rope_factor", "8",
          "--model.rope_original_max_len", "32", "--model.rope_theta", "500000",
          "--train.seq_len", "24")
ROWS = [("qkv biases tp2 sp", QWEN2, ["--parallel.tp", "2", "--parallel.sp", "true"]),
        ("qkv biases tied pp2", QWEN2, ["--parallel.pp", "2"]),
        ("q/k norms head_size 24 tp2", QWEN3, ["--parallel.tp", "2"]),
        ("llama3 rope scaling cp2 ring", LLAMA3, ["--parallel.cp", "2"])]


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *overrides))


def peft_adapter(tmp_path) -> tuple[str, ...]:
    """A tiny Qwen3 (q/k norms, head_dim 24) with the tiny preset's shape and a peft adapter
    on it, trained one step (B away from zero), saved: the overrides that continue it, the
    base loaded sharded."""
    import torch

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    base = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64))
    with torch.no_grad():  # q/k norm weights away from 1, so a misplaced one shows
        for name, p in base.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    base.save_pretrained(tmp_path / "hf")
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"]))
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    model.save_pretrained(tmp_path / "peft")
    return ("--model.init_from", str(tmp_path / "hf"), "--lora.init_from",
            str(tmp_path / "peft"), "--train.lr", "1e-2")


def test_family_pieces_parity_with_single_process(tmp_path):
    references = reference_runs(lambda name, *o: _text(tmp_path, name, *o))
    rows = [*ROWS, ("Qwen3 loaded sharded, peft adapter continued, tp2",
                      peft_adapter(tmp_path), ["--parallel.tp", "2"])]
    texts = [_text(tmp_path, f"row{i}", *model, *layout)
             for i, (_, model, layout) in enumerate(rows)]
    per_rank = run_distributed(train_layouts, 2, texts)
    for i, (label, model, _) in enumerate(rows):
        for rank, results in enumerate(per_rank):
            assert_parity(references(model), results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
