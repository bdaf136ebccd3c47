"""Part 6 of the GPU check: a Llama-3.2-1B-shaped model's training step, shardtrain's (bf16,
train.compile) against transformers' own (LlamaForCausalLM, SDPA attention, fused AdamW),
same shapes and batch, one after the other in this process.

    python benchmarks/gpu/mfu.py --device cuda --rows ROWS.jsonl [--cache DIR]

Both keep fp32 weights and compute under bf16 autocast (the same precision policy), clip
the gradient norm at 1 and step AdamW. Each: warm-up steps (shardtrain's first one
compiles), then the median of the timed steps: tokens/s, ms per step, MFU (the planner's
FLOPs per token, shardtrain.cost.counts, over the device's bf16 peak for both) and peak
memory; a third row gives shardtrain's tokens/s over transformers'. The tokens are random
ids for transformers (the cost does not depend on them) and the tiny preset's corpus
for shardtrain. On a CPU (`--device cpu`) a tiny model of the same family is the twin.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness import MIB, compile_backend, one_process, part_main, run_config
from shardtrain.config import ModelConfig
from shardtrain.cost.counts import model_flops_per_token
from shardtrain.train.observe.metrics import device_peak_flops

LLAMA_1B = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192,
            "vocab_size": 128256, "tie_embeddings": True, "rope_theta": 500000.0}
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
        "vocab_size": 512, "tie_embeddings": True, "rope_theta": 500000.0}
# device -> (model, sequence length, micro-batch, warm-up steps, timed steps)
SIZES = {"cuda": ("1B", LLAMA_1B, 2048, 4, 3, 10), "cpu": ("tiny", TINY, 32, 2, 1, 2)}


def _overrides(model: dict, seq: int, batch: int, steps: int) -> list[str]:
    out = [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in model.items()]
    return [*out, f"--model.max_seq_len={seq}", f"--train.seq_len={seq}",
            f"--train.micro_batch={batch}", f"--train.global_batch={batch}",
            f"--train.steps={steps}", "--train.precision=bf16", "--train.compile=true",
            "--train.eval_every=0", "--train.sample_tokens=0", "--optim.warmup_steps=1"]


def _rates(device, step_s: list[float], tokens: int, flops_per_token: float) -> dict:
    s = statistics.median(step_s)
    peak = device_peak_flops(device, 0.0 if device.type == "cuda" else 1e12, "bf16")
    peaks = {"peak_alloc_mib": torch.cuda.max_memory_allocated(device) / MIB,
             "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB} \
        if device.type == "cuda" else {}
    return {"tokens_per_s": tokens / s, "ms_per_step": s * 1e3,
            "mfu": None if peak is None else flops_per_token * tokens / (s * peak), **peaks}


def ours(device, run_dir: Path, cache: str | None) -> dict:
    _, model, seq, batch, warmup, steps = SIZES[device.type]
    cfg = run_config("tiny", run_dir, device,  # every model field and size overridden
                     *_overrides(model, seq, batch, warmup + steps), cache_dir=cache)
    with compile_backend(device):  # parallelize calls torch.compile as it builds
        trainer = one_process(cfg, device)
        records = [trainer.train_step() for _ in range(warmup + steps)]
    del trainer
    gc.collect()
    return _rates(device, [r["step_time_s"] for r in records[warmup:]], batch * seq,
                  model_flops_per_token(cfg.model, seq))


def theirs(device) -> dict:
    """transformers' training step: its model and loss, torch's fused AdamW."""
    import transformers

    from shardtrain.model.hf_names import hf_config_from_model

    _, model, seq, batch, warmup, steps = SIZES[device.type]
    cfg = ModelConfig(style="llama", max_seq_len=seq, **model)
    cfg.validate()
    hf = transformers.LlamaConfig(**hf_config_from_model(cfg), attn_implementation="sdpa")
    with torch.device(device):
        net = transformers.LlamaForCausalLM(hf)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    times = []
    for _ in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    del net, opt
    gc.collect()
    return _rates(device, times[warmup:], batch * seq, model_flops_per_token(cfg, seq))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    device, rows, args = part_main(__doc__, "mfu", cache=True)
    name = SIZES[device.type][0]
    with tempfile.TemporaryDirectory() as tmp:
        a = rows.guarded(f"shardtrain {name} bf16 compiled",
                         lambda: ours(device, Path(tmp) / "run", args.cache))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    b = rows.guarded(f"transformers {name} bf16 sdpa", lambda: theirs(device))
    if a["ok"] and b["ok"]:
        rows.add(f"shardtrain / transformers {name}", True,
                 tokens_per_s_ratio=a["tokens_per_s"] / b["tokens_per_s"])


if __name__ == "__main__":
    main()
