"""Compiled blocks against eager on one process: training tokens/s of the same model.

    python benchmarks/compile_throughput.py [--config default] [--steps 10] [--warmup 3]
                                            [--section.field VALUE ...]

Builds two trainers of `--config` (train.compile false and true) with the same seed and
data, in this process, and alternates their steps so both see the same machine load: first
the warm-up steps (the compiled trainer's first step compiles each graph: its time, less
the eager first step's, is reported as compile seconds), then `--steps` timed steps each.
Prints each one's tokens/s (the median step's), the ratio compiled / eager, and the
largest relative difference of their per-step losses; the last line is one JSON object.
A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer


def compare(preset: str, overrides: list[str], *, steps: int, warmup: int,
            run_dir: Path) -> dict:
    """Eager and compiled trainers of `preset`, steps alternated (module docstring)."""
    trainers = {}
    for mode, flag in (("eager", "false"), ("compiled", "true")):
        cfg = config.load(preset, ["--train.run_dir", str(run_dir / mode), "--train.progress",
                                   "false", "--train.steps", str(steps + warmup),
                                   *overrides, "--train.compile", flag])
        cfg.validate(1)
        device = torch.device("cuda" if cfg.train.device != "cpu"
                              and torch.cuda.is_available() else "cpu")
        trainers[mode] = Trainer(cfg, build_mesh(MeshShape(), device=device), device)
    first, times = {}, {mode: [] for mode in trainers}
    losses = {mode: [] for mode in trainers}
    for i in range(warmup + steps):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            record = trainer.train_step()  # its .item() calls end the step on the device
            seconds = time.perf_counter() - start
            losses[mode].append(record["loss"])
            if i == 0:
                first[mode] = seconds
            elif i >= warmup:
                times[mode].append(seconds)
    tokens = trainers["eager"].tokens_per_step
    rate = {mode: tokens / statistics.median(t) for mode, t in times.items()}
    deviation = max(abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled"]))
    return {"preset": preset, "device": str(trainers["eager"].device),
            "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
            "eager_tokens_per_s": rate["eager"], "compiled_tokens_per_s": rate["compiled"],
            "ratio": rate["compiled"] / rate["eager"],
            "compile_s": first["compiled"] - first["eager"],
            "worst_loss_deviation": deviation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = compare(args.config, overrides, steps=args.steps, warmup=args.warmup,
                    run_dir=Path(tmp))
    print(f"{r['preset']} on {r['device']}, {r['tokens_per_step']} tokens per step, median of "
          f"{r['steps']} steps after {r['warmup']} warm-up")
    print(f"eager    {r['eager_tokens_per_s']:10.0f} tokens/s")
    print(f"compiled {r['compiled_tokens_per_s']:10.0f} tokens/s  (x{r['ratio']:.2f}; "
          f"compile {r['compile_s']:.1f} s in the first step)")
    print(f"worst relative per-step loss difference {r['worst_loss_deviation']:.1e}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
