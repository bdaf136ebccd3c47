"""Tokens/s of one training step (forward + backward) of a mixture-of-experts model with
`model.moe_impl=grouped` (one grouped matmul per projection) vs `loop` (a Python loop over
experts, a host sync each step), one process. Prints one line per impl and a JSON line.

    python benchmarks/moe_grouped.py [--dim 256 --experts 8 --top-k 2 --seq 256 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardtrain.config import ModelConfig
from shardtrain.model.transformer import build_model


def build(impl: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                      n_experts=args.experts, moe_top_k=args.top_k, max_seq_len=args.seq,
                      moe_impl=impl)
    cfg.validate()
    return build_model(cfg, device=device, seed=0)


def step_time(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool) -> float:
    device = tokens.device
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def tokens_per_s(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median step time per impl, the two impls' steps interleaved (a shared machine's
    load then weighs on both alike)."""
    models = {impl: build(impl, args, device) for impl in ("grouped", "loop")}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    times: dict[str, list[float]] = {impl: [] for impl in models}
    for i in range(args.warmup + args.steps):
        for impl, model in models.items():
            t = step_time(model, tokens, args.bf16)
            if i >= args.warmup:
                times[impl].append(t)
    return {impl: args.batch * args.seq / statistics.median(ts) for impl, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="autocast to bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    result = tokens_per_s(args, device)
    for impl, rate in result.items():
        print(f"{impl:8s} {rate:12.0f} tokens/s")
    ratio = result["grouped"] / result["loop"]
    print(f"grouped / loop: {ratio:.2f}x")
    print(json.dumps({"device": str(device), **vars(args),
                      "grouped_tokens_per_s": result["grouped"],
                      "loop_tokens_per_s": result["loop"], "ratio": ratio}))


if __name__ == "__main__":
    main()
