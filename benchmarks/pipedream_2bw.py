"""PipeDream-2BW beside 1F1B on the default model: loss against steps, and the memory the
stashed weight version costs.

    python benchmarks/pipedream_2bw.py [--steps 100] [--every 10] [--out runs/pd2bw]
                                       [--section.field VALUE ...]

Runs `shardtrain train --nproc 2` (the default preset's model, pp = 2, m = 2 micro-batches
per step: its global batch of 16 in micro-batches of 8; sequences of 64 tokens, not 256, so
both runs take under 3 minutes on a 2-core CPU) twice with the same seed and data,
differing only in `parallel.schedule` (1f1b, pipedream-2bw), then prints every `--every`-th
step's training loss of both, the final eval loss of each, and one JSON line. Then the
stash's bytes per rank -- one copy of the busiest stage's parameters
(plan/partition.py rank_params; fp32, the parameters' dtype in every precision here, and
bf16) -- for the default model at pp = 2 and llama3-8b at pp = 8. A figure, never a test.

    python benchmarks/pipedream_2bw.py --speed [--nproc 2|4] [--steps 10]
                                       [--section.field VALUE ...]

The wall time instead: one launch of `--nproc` pipeline stages (pp = nproc; the default
model, with --model.n_layers 8 at 4), m = 8 micro-batches of 2 sequences of 256 tokens,
a trainer of each schedule on the same mesh, one step of each in turn (alternating which
goes first), tokens/s of the last stage and, as the last line, one JSON object with
steps/s of each and the ratio 2BW / 1F1B. The runtime runs each 2BW step in 1F1B's order
with a flush (docs/pipeline.md says why), so the ratio is the cost of the weight
versions' swap, not the schedule's missing drain.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from shardtrain import config
from shardtrain.parallel.pipeline.pipedream import NAME, stash_bytes
from shardtrain.plan.layout import Layout
from shardtrain.plan.partition import rank_params


def train(schedule: str, steps: int, run_dir: Path, overrides: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "shardtrain", "train", "--nproc", "2",
           "--parallel.pp", "2", "--parallel.schedule", schedule,
           "--train.steps", str(steps), "--train.eval_every", "0", "--train.log_every", "1",
           "--train.run_dir", str(run_dir), "--train.overwrite", "true",
           "--train.progress", "false", "--train.sample_tokens", "0", "--train.seq_len", "64",
           *overrides]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stash_memory() -> dict[str, dict[str, float]]:
    """The second version's bytes on the busiest rank (the planner's parameter count)."""
    out = {}
    for preset, pp in (("default", 2), ("llama3-8b", 8)):
        params = rank_params(config.load(preset, []).model, Layout(pp=pp, microbatches=pp)).total
        out[f"{preset} pp={pp}"] = {"params_per_rank": params,
                                    "fp32_bytes": stash_bytes(int(params), 4),
                                    "bf16_bytes": stash_bytes(int(params), 2)}
    return out


def worker(texts: dict[str, str], steps: int) -> dict[str, float]:
    import torch

    from interleave import interleaved_tokens_per_s
    from teardown import run_then_leave
    from shardtrain.comm import build_mesh
    from shardtrain.launch import ProcessInfo, init_distributed
    from shardtrain.mesh import MeshShape
    from shardtrain.train.trainer import Trainer

    info = ProcessInfo.from_env()
    cfgs = {s: config.loads(t) for s, t in texts.items()}
    init_distributed(info, torch.device("cpu"), cfgs["1f1b"].comm.timeout_s)

    def measure() -> dict[str, float]:
        mesh = build_mesh(MeshShape(pp=info.world_size), rank=info.rank)
        trainers = {s: Trainer(c, mesh, torch.device("cpu")) for s, c in cfgs.items()}
        t = cfgs["1f1b"].train
        return interleaved_tokens_per_s({s: tr.train_step for s, tr in trainers.items()},
                                        steps=steps, tokens_per_step=t.global_batch * t.seq_len)
    return run_then_leave(measure)


def speed(nproc: int, steps: int, overrides: list[str]) -> None:
    from shardtrain.launch import launch_local

    texts = {}
    for s in ("1f1b", NAME):
        cfg = config.load("default", ["--parallel.pp", str(nproc), "--parallel.schedule", s,
                                      "--train.global_batch", "16", "--train.micro_batch", "2",
                                      "--train.progress", "false", "--train.run_dir",
                                      f"runs/bench-{s}", *overrides])
        cfg.validate(nproc)
        texts[s] = config.to_toml(cfg)
    from pipedream_2bw import worker as entry  # by module name: ranks cannot unpickle __main__'s

    tokens = launch_local(nproc, entry, texts, steps)[nproc - 1]  # the last stage's timing
    per_step = 16 * cfg.train.seq_len
    for s, v in tokens.items():
        print(f"{s:14s} {v:8.0f} tokens/s  {v / per_step:6.3f} steps/s")
    print(json.dumps({"pp": nproc, "steps_per_s": {s: round(v / per_step, 4) for s, v in
                                                   tokens.items()},
                      "ratio_2bw_over_1f1b": round(tokens[NAME] / tokens["1f1b"], 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default="runs/pd2bw")
    parser.add_argument("--speed", action="store_true", help="wall time, not loss (doc)")
    parser.add_argument("--nproc", type=int, default=2, help="with --speed: parallel.pp")
    args, overrides = parser.parse_known_args()
    if args.speed:
        return speed(args.nproc, args.steps, overrides)
    runs = {s: train(s, args.steps, Path(args.out) / s, overrides)
            for s in ("1f1b", "pipedream-2bw")}
    losses = {s: [r["loss"] for r in recs if "loss" in r and r.get("step")] for s, recs in runs.items()}
    print(f"\n{'step':>5} {'1f1b':>8} {'2bw':>8}")
    for i in range(0, args.steps, args.every):
        print(f"{i + 1:5d} {losses['1f1b'][i]:8.4f} {losses['pipedream-2bw'][i]:8.4f}")
    last = args.steps - 1
    print(f"{last + 1:5d} {losses['1f1b'][last]:8.4f} {losses['pipedream-2bw'][last]:8.4f}")
    evals = {s: next((r["eval_loss"] for r in reversed(recs) if "eval_loss" in r), None)
             for s, recs in runs.items()}
    memory = stash_memory()
    for name, m in memory.items():
        print(f"stash {name}: {m['params_per_rank'] / 1e6:.2f} M params/rank, "
              f"{m['fp32_bytes'] / 2**20:.1f} MiB fp32, {m['bf16_bytes'] / 2**20:.1f} MiB bf16")
    print(json.dumps({"steps": args.steps, "eval_loss": evals, "stash": memory,
                      "losses": {s: l[::args.every] for s, l in losses.items()}}))


if __name__ == "__main__":
    main()
