"""The dry run's peak against the planner's, per model family: rank 0 of an 8-rank job built
and stepped in this one process over the fake process group (`shardtrain train
--dry-run-world 8`, train/start/dryrun.py), its measured step peak within the planner's
`memory_per_gpu` total (plan/memory.py) plus a margin.

The step peak is what rank 0 holds at the busiest moment of its last step: its model states
plus the most bytes allocated at once during the step above those at its start
(train/start/meters.py: on CPU the bytes malloc has handed out, sampled after every
tensor op; on a GPU the allocator's own count). The planner's figure is model states,
saved activations (its own block count, the head's and the loss's) and the largest
transient of backward's moments (plan/buffers.py).

Margin: 3% of the planner's figure + 0.5 MiB. What the planner does not count: the step's
non-tensor allocations (autograd's graph, Python objects) and its small tensors (token
indices, routing masks, reduction scalars), and an op's temporaries only as its output;
on these models that came to at most 0.6 MB (3%) above the planner's figure. A margin
this tight is what keeps differences from hiding: before the planner counted the loss's
[n, V] log-probabilities and gradients, the qk-norms' saved inputs and autocast's weight
copies, the GQA + qk-norm (Qwen3) rows measured 6% to 27% above the planner, the
tensor-parallel ones 20% above; before ZeRO reduced a tied table's unit last, the tied
ZeRO-3 row held every unit gathered and every full gradient at backward's end, 2x the
planner's figure (61 MB against 30 MB), while the untied row met it.

Families: Llama untied and tied (Llama 3.2 and Qwen2.5 up to 3B tie), GPT-2 (tied,
learned positions, biases), Qwen3-style (1 kv head of 4: GQA, shared by both ranks under
tp = 2; qk-norm; tied) and a mixture of experts. Two shapes: vocabulary-heavy (the loss's
[n, V] tensors and the vocabulary units dominate, as in small models with 128k-152k
vocabularies) and parameter-heavy (the blocks' units and their gradients dominate; bucket
1 MiB, each unit reduced alone). MoE rows run in fp32: on CPU torch's bf16 grouped matmul
keeps ~2 MB of workspace per routing pattern it has seen (not a tensor; it grows step after
step), which no planner term describes.
"""

from __future__ import annotations

import pytest
import torch

from parity import tiny
from shardtrain.train.start.meters import malloc_in_use_bytes
from shardtrain.train.start.dryrun import dry_run

WORLD = 8
MARGIN_RATIO, MARGIN_BYTES = 0.03, 2**19
# vocabulary-heavy: the loss's fp32 [256, 4096] is 4.2 MB, a block's parameters 0.8 MB
VOCAB = ("--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "4",
         "--model.vocab_size", "4096", "--model.max_seq_len", "128", "--train.seq_len", "128",
         "--train.micro_batch", "2")
# parameter-heavy: 8 blocks of 3.2 MB, 32 tokens per micro-batch, units reduced alone
PARAMS = ("--model.dim", "256", "--model.n_layers", "8", "--model.n_heads", "4",
          "--model.vocab_size", "1024", "--model.max_seq_len", "64", "--train.seq_len", "16",
          "--train.micro_batch", "2", "--comm.bucket_mb", "1")
LLAMA = ("--model.n_kv_heads", "2", "--model.tie_embeddings", "false")
TIED = ("--model.n_kv_heads", "2", "--model.tie_embeddings", "true")
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
QWEN3 = ("--model.n_kv_heads", "1", "--model.qk_norm", "true", "--model.tie_embeddings", "true")
MOE = ("--model.n_kv_heads", "2", "--model.n_experts", "4", "--model.moe_top_k", "2")


def _zero(stage: int, *more: str) -> tuple[str, ...]:
    return ("--parallel.zero", str(stage), "--train.global_batch", "16", *more)


TP2 = ("--parallel.tp", "2", "--train.global_batch", "8")
BF16 = ("--train.precision", "bf16")
ROWS = {  # name: (shape, family, layout)
    "llama zero3": (VOCAB, LLAMA, _zero(3)),
    "llama dp": (VOCAB, LLAMA, _zero(0)),
    "llama zero3 param-heavy": (PARAMS, LLAMA, _zero(3)),
    "llama tied zero3 param-heavy": (PARAMS, TIED, _zero(3)),
    "llama tied zero2": (VOCAB, TIED, _zero(2)),
    "gpt2 zero3 bf16": (VOCAB, GPT2, _zero(3, *BF16)),
    "gpt2 zero1 tp2": (VOCAB, GPT2, ("--parallel.zero", "1", *TP2)),
    "qwen3 zero3": (VOCAB, QWEN3, _zero(3)),
    "qwen3 zero1 tp2 bf16": (VOCAB, QWEN3, ("--parallel.zero", "1", *TP2, *BF16)),
    "moe zero3 ep2": (VOCAB, MOE, _zero(3, "--parallel.ep", "2")),
    "moe zero2": (VOCAB, MOE, _zero(2)),
}


# qk-norm under autocast: bf16 heads, an fp32 norm weight (torch's unfused path; a warning)
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.skipif(malloc_in_use_bytes() is None,
                    reason="the CPU step peak needs glibc's mallinfo2 (glibc >= 2.33)")
@pytest.mark.parametrize("name", list(ROWS))
def test_dry_run_peak_within_the_planner(tmp_path, capsys, name):
    shape, family, layout = ROWS[name]
    cfg = tiny(tmp_path, name.replace(" ", "-"), *shape, *family, *layout,
               "--train.steps", "2")
    report = dry_run(cfg, WORLD, torch.device("cpu"))
    capsys.readouterr()  # the report's table
    measured, planned = report["measured"], report["planned_estimate"]
    peak, total = measured["step_peak"], planned["total"]
    limit = total * (1 + MARGIN_RATIO) + MARGIN_BYTES
    print(f"{name}: step peak {peak / 1e6:.2f} MB, planner {total / 1e6:.2f} MB "
          f"(ratio {peak / total:.2f}; states {measured['model_states'] / 1e6:.2f}, saved "
          f"{measured['saved_activations'] / 1e6:.2f} MB, planned "
          f"{planned['activations'] / 1e6:.2f} + buffers {planned['buffers'] / 1e6:.2f})")
    assert report["skipped_steps"] == 0
    assert peak <= limit, f"{name}: {peak:,} B > planner {total:,.0f} B + margin"
