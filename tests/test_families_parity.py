"""The pieces of today's Hugging Face families (model/hf_families.py) under the layouts
that touch them, against the single-process run (fp32 losses, eval loss, final weights):
q/k/v biases (Qwen2) under tp=2 with sp and under pp=2 (tied head), per-head q/k norms
with a head size other than dim / n_heads (Qwen3) under tp=2 (each rank normalises only
its heads, so their gradients are summed over tp) and under ZeRO-3, and llama3 RoPE
scaling under cp=2 ring and Ulysses attention (positions of a zig-zag chunk index the
scaled tables). One spawn."""

from __future__ import annotations

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
        ("q/k norms head_size 24 dp2 zero3", QWEN3, ["--parallel.zero", "3"]),
        ("llama3 rope scaling cp2 ring", LLAMA3, ["--parallel.cp", "2"]),
        ("llama3 rope scaling cp2 ulysses", LLAMA3, ["--parallel.cp", "2",
                                                     "--parallel.cp_mode", "ulysses"])]


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *overrides))


def test_family_pieces_parity_with_single_process(tmp_path):
    references = reference_runs(lambda name, *o: _text(tmp_path, name, *o))
    texts = [_text(tmp_path, f"row{i}", *model, *layout)
             for i, (_, model, layout) in enumerate(ROWS)]
    per_rank = run_distributed(train_layouts, 2, texts)
    for i, (label, model, _) in enumerate(ROWS):
        for rank, results in enumerate(per_rank):
            assert_parity(references(model), results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
