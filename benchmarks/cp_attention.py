"""Context-parallel attention on fused kernels (issue 30): peak memory per rank and the time
of ONE training step at cp=N, for this checkout and, in the same run, a baseline checkout.

    python benchmarks/cp_attention.py [--seqs 16384 32768] [--cp 4] [--mode ring]
                                      [--precision fp32] [--baseline TREE]

The tiny preset's model (dim 64, 2 layers, 4 heads, 2 kv heads, vocab 256) at each `--seqs`
length, one sequence per step (micro and global batch 1), the zig-zag split, Gloo on CPU:
attention is what grows with the sequence. Each rank builds its trainer, resets its peak
resident set size (train/metrics.reset_peak_memory: Linux's VmHWM), runs one train_step
and reports its peak RSS, its RSS before the step, and the step's seconds.

`--baseline TREE`: a checkout of another commit (`git worktree add /tmp/base 9fb06dc`).
Every measurement runs in a subprocess of this script whose PYTHONPATH is the tree measured
(this checkout, then TREE), so both use the same command, model and data, and the last
lines give the ratios baseline / this checkout. Figures, never tests: times depend on the
machine's load (ranks share its cores); the peak memory is what the comparison is about.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
HERE = Path(__file__).resolve().parents[1]


def worker(cfg_text: str) -> dict:
    import torch

    from shardtrain import config
    from shardtrain.launch import ProcessInfo, init_distributed
    from teardown import run_then_leave  # this checkout's, whichever tree is measured

    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 600.0)
    return run_then_leave(one_step, cfg, info.rank)  # teardown.py: the exit without a hang


def one_step(cfg, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from shardtrain.comm import build_mesh
    from shardtrain.mesh import MeshShape
    from shardtrain.train.observe.metrics import peak_memory, reset_peak_memory
    from shardtrain.train.trainer import Trainer

    device = torch.device("cpu")
    mesh = build_mesh(MeshShape(dp=1, cp=cfg.parallel.cp), rank=rank, timeout_s=600.0)
    trainer = Trainer(cfg, mesh, device)
    dist.barrier()
    before = reset_peak_memory(device)
    start = time.perf_counter()
    trainer.train_step()
    step_s = time.perf_counter() - start
    peak = peak_memory(device)["peak_mem_bytes"]
    return {"rss_before": before, "peak": peak, "step_s": step_s}


def measure(seq: int, cp: int, mode: str, precision: str) -> dict:
    """One launch of cp ranks (in the tree on PYTHONPATH): per-rank figures."""
    from shardtrain import config
    from shardtrain.launch import launch_local

    root = Path(tempfile.mkdtemp(prefix="cp_attention_"))
    cfg = config.load("tiny", [
        "--train.run_dir", str(root / "run"), "--data.cache_dir", str(root / "cache"),
        "--train.seq_len", str(seq), "--model.max_seq_len", str(seq),
        "--train.micro_batch", "1", "--train.global_batch", "1", "--train.steps", "1",
        "--train.eval_every", "0", "--train.eval_batches", "1", "--train.progress", "false",
        "--train.log_every", "1000", "--train.precision", precision,
        "--parallel.cp", str(cp), "--parallel.cp_mode", mode])
    cfg.validate(cp)
    results = launch_local(cp, worker, config.to_toml(cfg))
    return {key: [results[r][key] for r in range(cp)] for key in results[0]}


def run_tree(tree: Path, args, seq: int) -> dict:
    """`measure` in a subprocess that imports shardtrain from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--seqs", str(seq),
           "--cp", str(args.cp), "--mode", args.mode, "--precision", args.precision]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the measurement in {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(name: str, seq: int, r: dict) -> str:
    return (f"  {name:<9} seq {seq:>6}: peak RSS per rank {max(r['peak']) / MIB:7.0f} MiB "
            f"(ranks {', '.join(f'{p / MIB:.0f}' for p in r['peak'])}; before the step "
            f"{max(r['rss_before']) / MIB:.0f}), step {max(r['step_s']):6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--cp", type=int, default=4, help="context-parallel ranks")
    parser.add_argument("--mode", default="ring", choices=("ring", "ulysses"))
    parser.add_argument("--precision", default="fp32", help="train.precision")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of the commit to compare with (PYTHONPATH root)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the subprocess: one length, in the tree on PYTHONPATH
        print(json.dumps(measure(args.seqs[0], args.cp, args.mode, args.precision)))
        return
    trees = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    print(f"tiny model, cp={args.cp} {args.mode} (zig-zag), {args.precision}, one train_step, "
          f"one sequence; trees: " + ", ".join(f"{k} {v}" for k, v in trees.items()))
    summary: dict = {"cp": args.cp, "mode": args.mode, "precision": args.precision, "runs": {}}
    for seq in args.seqs:
        for name, tree in trees.items():
            r = run_tree(tree, args, seq)
            summary["runs"][f"{name} {seq}"] = r
            print(_row(name, seq, r), flush=True)
        if args.baseline:
            this, base = summary["runs"][f"this {seq}"], summary["runs"][f"baseline {seq}"]
            mem = max(base["peak"]) / max(this["peak"])
            grow = (max(p - b for p, b in zip(base["peak"], base["rss_before"]))
                    / max(p - b for p, b in zip(this["peak"], this["rss_before"])))
            secs = max(base["step_s"]) / max(this["step_s"])
            summary[f"ratio {seq}"] = {"peak": mem, "step_growth": grow, "step_s": secs}
            print(f"  baseline / this at {seq}: peak RSS {mem:.2f}x, the step's growth over its "
                  f"starting RSS {grow:.2f}x, step time {secs:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
