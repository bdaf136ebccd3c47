"""Compression on the default run: uncompressed, int8 (gradients) and top-k (1% of each
tensor's optimizer update, error feedback, sparsity warm-up).

    python benchmarks/compression_default_run.py [--nproc 2] [--out runs/compression]
                                                 [--section.field VALUE ...]

Runs `shardtrain train` (the default preset) three times with the same seed and data,
differing only in `comm.compress`, then reads each run's metrics.jsonl and prints, per run,
the final eval loss, the mean of the last 10 training losses, and the bytes this rank sent
per step, averaged over every step of the run (the ledger's comm_bytes: gradients or sparse
updates, plus a few metric bytes). The last line is one JSON object with the ratios the
issue asks about (bytes saved vs uncompressed; final eval loss relative to uncompressed).
A figure, never a test: it takes a few minutes per run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# top-k: 1% of each tensor's update after DGC's sparsity warm-up (25% falling to 1% over
# the first 50 steps; the bytes per step are averaged over the whole run, warm-up included).
RUNS = (("none", []), ("int8", []),
        ("topk", ["--comm.topk_ratio", "0.01"]))


def train(kind: str, extra: list[str], nproc: int, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "shardtrain", "train", "--nproc", str(nproc),
           "--train.run_dir", str(run_dir), "--train.progress", "false",
           "--train.sample_tokens", "0", "--comm.compress", kind, *extra, *overrides]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    return {"final_eval_loss": next(r["eval_loss"] for r in reversed(records) if "eval_loss" in r),
            "last10_train_loss": sum(losses[-10:]) / len(losses[-10:]),
            "comm_bytes_per_step": sum(r["comm_bytes"] for r in records) / len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="runs/compression")
    args, overrides = parser.parse_known_args()
    results = {kind: train(kind, extra, args.nproc, Path(args.out) / kind, overrides)
               for kind, extra in RUNS}
    base = results["none"]
    print(f"\n{'compress':>8} {'eval loss':>10} {'train loss':>11} {'bytes/step':>12} "
          f"{'fewer bytes':>12} {'loss vs none':>13}")
    summary = {}
    for kind, r in results.items():
        fewer = base["comm_bytes_per_step"] / r["comm_bytes_per_step"]
        rel = r["final_eval_loss"] / base["final_eval_loss"] - 1
        summary[kind] = {**r, "bytes_ratio": fewer, "eval_loss_vs_none": rel}
        print(f"{kind:>8} {r['final_eval_loss']:10.4f} {r['last10_train_loss']:11.4f} "
              f"{r['comm_bytes_per_step']:12.0f} {fewer:11.1f}x {rel:+12.2%}")
    print(json.dumps({"nproc": args.nproc, "runs": summary}))


if __name__ == "__main__":
    main()
