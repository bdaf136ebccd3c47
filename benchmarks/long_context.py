"""Long context with context parallelism: activation memory per rank and attention load
balance, from the trainer itself.

    python benchmarks/long_context.py [--seq 8192] [--cp 4] [--steps 3] [--cap-mb 64]

The tiny preset's model (dim 64, 2 layers, 4 heads, 2 kv heads) at `--seq` tokens, one
sequence per step. Three runs of the trainer (Gloo, CPU):
- cp=1 (one process) and cp=N ring with the zig-zag split: each rank's bytes saved for
  backward by one micro-batch's forward (the saved-activation meter,
  parallel/activation.py), next to the planner's activation figure, and whether each fits
  under `--cap-mb` per rank;
- cp=N ring with the contiguous split: each rank's attention compute seconds per step from
  the runtime's timelines (`attention_s`, also written to `timeline_rank{R}.json`), the
  least over the steps after the first (a shared machine only adds time), for both splits,
  with the busiest / least busy ratio over ranks.
The last line is one JSON object. Figures, never tests: the machine's load moves the times.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from teardown import run_then_leave
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.parallel.activation import SavedActivations
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.train.trainer import Trainer

MIB = 2**20


def overrides(run_dir: Path, seq: int, cp: int, split: str, steps: int) -> list[str]:
    return ["--train.run_dir", str(run_dir), "--data.cache_dir", str(run_dir.parent / "cache"),
            "--train.seq_len", str(seq), "--model.max_seq_len", str(seq),
            "--train.micro_batch", "1", "--train.global_batch", "1",
            "--train.steps", str(steps), "--train.eval_every", "0", "--train.eval_batches", "1",
            "--train.progress", "false", "--train.log_every", "1000",
            "--parallel.cp", str(cp), "--parallel.cp_split", split]


def worker(cfg_text: str) -> dict:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 600.0)
    return run_then_leave(measure, cfg, info)  # teardown.py: the exit without a hang


def measure(cfg: config.Config, info: ProcessInfo) -> dict:
    device = torch.device("cpu")
    p = cfg.parallel
    mesh = build_mesh(MeshShape(dp=1, cp=p.cp), rank=info.rank, timeout_s=600.0)
    trainer = Trainer(cfg, mesh, device)
    model = trainer.parallel.module
    inputs, targets = trainer.parallel.pipeline._mine(trainer.sampler.next_step()[0])
    with SavedActivations(exclude=model) as meter:
        loss = cross_entropy(model(inputs), targets)
    with trainer.parallel.update.no_sync():  # a measurement: no gradient traffic
        loss.backward()
    trainer.sampler.step = 0  # the measured batch was not a training step
    attention = []  # each step's timeline: this rank's attention seconds
    for _ in range(cfg.train.steps):
        trainer.train_step()
        attention.append(trainer.parallel.timeline.get("attention_s"))
    trainer.write_timeline()
    peak = trainer.memory_ledger()["peak_mem_bytes"]
    # The first step warms up; of the rest the least: other load only adds time (cp=1
    # has no context-parallel core, so no attention_s).
    timed = [t for t in attention[1:] or attention if t is not None]
    return {"saved_bytes": meter.bytes, "attention_s": min(timed) if timed else None,
            "peak_rss": peak}


def run(root: Path, seq: int, cp: int, split: str, steps: int) -> list[dict]:
    cfg = config.load("tiny", overrides(root / f"cp{cp}-{split}", seq, cp, split, steps))
    cfg.validate(cp)
    results = launch_local(cp, worker, config.to_toml(cfg))
    return [results[r] for r in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--cp", type=int, default=4, help="context-parallel ranks")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cap-mb", type=float, default=64.0,
                        help="a per-rank activation budget, MiB: which layouts fit under it")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="long_context_"))
    model = config.load("tiny", overrides(root, args.seq, 1, "zigzag", 1)).model
    runs = {"cp1": run(root, args.seq, 1, "zigzag", args.steps),
            "zigzag": run(root, args.seq, args.cp, "zigzag", args.steps),
            "contiguous": run(root, args.seq, args.cp, "contiguous", args.steps)}
    summary: dict = {"seq": args.seq, "cp": args.cp, "cap_mb": args.cap_mb}
    print(f"tiny model at {args.seq} tokens, one sequence per step; activation bytes saved "
          f"for backward per rank (one micro-batch), budget {args.cap_mb:g} MiB")
    for name, cp in (("cp1", 1), ("zigzag", args.cp)):
        saved = max(r["saved_bytes"] for r in runs[name])
        plan = memory_per_gpu(model, Layout(cp=cp, precision="fp32"), seq_len=args.seq)
        fits = saved <= args.cap_mb * MIB
        print(f"  cp={cp}: measured {saved / MIB:8.1f} MiB, planner {plan.activations / MIB:8.1f}"
              f" MiB, peak RSS {max(r['peak_rss'] for r in runs[name]) / MIB:7.0f} MiB: "
              f"{'fits' if fits else 'exceeds the budget'}")
        summary[f"cp{cp}_saved_bytes"] = saved
        summary[f"cp{cp}_planner_bytes"] = plan.activations
        summary[f"cp{cp}_fits"] = fits
    summary["saved_ratio"] = summary[f"cp{args.cp}_saved_bytes"] / summary["cp1_saved_bytes"]
    print(f"  ratio cp={args.cp} / cp=1: {summary['saved_ratio']:.3f}")
    print(f"attention compute seconds per step and rank (timelines; least of steps 2..), "
          f"cp={args.cp} ring")
    for name in ("zigzag", "contiguous"):
        secs = [r["attention_s"] for r in runs[name]]
        ratio = max(secs) / min(secs)
        print(f"  {name:>10}: " + "  ".join(f"rank {i} {t:.3f}s" for i, t in enumerate(secs))
              + f"   busiest / least busy {ratio:.2f}")
        summary[name] = {"attention_s": [round(t, 4) for t in secs],
                         "max_over_min": round(ratio, 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
