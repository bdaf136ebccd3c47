"""Auxiliary-loss-free balancing against the auxiliary loss on a task whose router would
collapse: the tiny preset with 8 experts (top-2) on synthetic text whose bytes follow a
steep Zipf law (a few tokens are most of the stream, so their identical inputs crowd the
same experts). Per recipe: MaxVio (max load / mean load - 1, metrics.jsonl's moe_maxvio,
mean over layers) at the start and over the last 20 steps, and the eval loss at the end.

    python benchmarks/moe_bias_balance.py [--task zipf|topics --steps 200 --seed 0
                                           --zipf 1.6 --rate 0.001 --recipes bias]

`--task zipf`: i.i.d. bytes (identical inputs, which no bias can split); `--task topics`:
skewed topics, each a Markov chain over its own symbols (varied contexts; docs/moe.md).

`--rate` is the bias recipes' model.moe_bias_rate (DeepSeek-V3's 0.001 is for runs of
thousands of steps: the bias moves at most rate x steps); `--recipes` keeps the recipes
whose label contains it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer

RECIPES = {  # label: model overrides
    "aux (softmax, coef 0.01)": (),
    "aux (sigmoid, coef 0.01)": ("--model.moe_score", "sigmoid"),
    "none (softmax)": ("--model.moe_balance", "none", "--model.moe_aux_loss_coef", "0"),
    "bias (softmax)": ("--model.moe_balance", "bias", "--model.moe_aux_loss_coef", "0"),
    "bias (sigmoid, seq loss 1e-4)": ("--model.moe_score", "sigmoid", "--model.moe_balance",
                                      "bias", "--model.moe_aux_loss_coef", "0.0001"),
}


def skewed_text(path: Path, n_bytes: int, s: float, seed: int) -> None:
    """n_bytes of printable bytes drawn from a Zipf law of exponent s over 64 symbols,
    in lines of 80 (a plain text source)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, 65, dtype=torch.float64)
    draws = torch.multinomial(ranks.pow(-s), n_bytes, replacement=True, generator=gen)
    symbols = [chr(33 + i) for i in range(64)]
    text = "".join(symbols[i] for i in draws.tolist())
    path.write_text("\n".join(text[i:i + 80] for i in range(0, len(text), 80)))


def topic_text(path: Path, n_bytes: int, s: float, seed: int) -> None:
    """n_bytes in lines of 80, each line from one of 8 topics drawn by a Zipf law of
    exponent s (the commonest topic ~ half the lines at s = 1.6). A topic is a Markov chain
    over its own 24 of the 64 symbols, each symbol followed by one of 4 others: the stream
    is skewed, as the Zipf bytes are, but a frequent symbol appears in varied contexts, so
    its tokens' inputs to a router differ and can be spread over experts."""
    gen = torch.Generator().manual_seed(seed)
    n_topics, alphabet, fanout = 8, 24, 4
    weights = torch.arange(1, n_topics + 1, dtype=torch.float64).pow(-s)
    symbols = [chr(33 + i) for i in range(64)]
    topics = [torch.randperm(64, generator=gen)[:alphabet] for _ in range(n_topics)]
    nexts = [torch.randint(0, alphabet, (alphabet, fanout), generator=gen)
             for _ in range(n_topics)]
    lines = []
    for _ in range(n_bytes // 81):
        t = int(torch.multinomial(weights, 1, generator=gen))
        state = int(torch.randint(0, alphabet, (1,), generator=gen))
        picks = torch.randint(0, fanout, (80,), generator=gen).tolist()
        line = []
        for pick in picks:
            line.append(symbols[int(topics[t][state])])
            state = int(nexts[t][state, pick])
        lines.append("".join(line))
    path.write_text("\n".join(lines))


TASKS = {"zipf": skewed_text, "topics": topic_text}


def run(label: str, overrides: tuple, args: argparse.Namespace, tmp: Path) -> dict:
    name = "".join(c if c.isalnum() else "-" for c in label)
    cfg = config.load("tiny", [
        "--train.run_dir", str(tmp / name), "--data.source", str(tmp / "skewed.txt"),
        "--data.cache_dir", str(tmp / "cache"), "--train.steps", str(args.steps),
        "--train.seed", str(args.seed), "--model.n_experts", "8", "--model.moe_top_k", "2",
        "--checkpoint.every", "0", "--train.eval_batches", "8", *args.model.split(), *overrides,
        *(("--model.moe_bias_rate", str(args.rate)) if "bias" in label else ())])
    trainer = Trainer(cfg, build_mesh(MeshShape(), rank=0), torch.device("cpu"))
    result = trainer.run()
    maxvio = [sum(r["moe_maxvio"]) / len(r["moe_maxvio"]) for r in result.history]
    tail = maxvio[-20:]
    return {"recipe": label, "maxvio_first": round(maxvio[0], 3),
            "maxvio_last20": round(sum(tail) / len(tail), 3),
            "eval_loss": round(result.eval_loss, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=list(TASKS), default="zipf",
                   help="zipf: i.i.d. skewed bytes; topics: skewed topics of varied contexts")
    p.add_argument("--zipf", type=float, default=1.6,
                   help="the Zipf exponent of the bytes (zipf) or of the topics (topics)")
    p.add_argument("--model", default="",
                   help="extra model overrides for every recipe, e.g. '--model.n_layers 4'")
    p.add_argument("--rate", type=float, default=0.001, help="the bias recipes' bias rate")
    p.add_argument("--recipes", default="", help="only the recipes whose label has this")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        TASKS[args.task](tmp / "skewed.txt", 400_000, args.zipf, seed=1234)
        rows = [run(label, o, args, tmp) for label, o in RECIPES.items()
                if args.recipes in label]
    print(f"{'recipe':<32} {'MaxVio step 1':>13} {'last 20':>8} {'eval loss':>9}")
    for r in rows:
        print(f"{r['recipe']:<32} {r['maxvio_first']:>13.3f} {r['maxvio_last20']:>8.3f} "
              f"{r['eval_loss']:>9.4f}")
    print(json.dumps({"task": args.task, "steps": args.steps, "seed": args.seed,
                      "zipf": args.zipf, "model": args.model,
                      "rate": args.rate, "rows": rows}))


if __name__ == "__main__":
    main()
