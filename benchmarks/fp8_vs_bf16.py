"""FP8 linears (train.fp8) against bf16: training tokens/s of the same model in one process.

    python benchmarks/fp8_vs_bf16.py [--config default] [--steps 10] [--warmup 3]
                                     [--recipe tensorwise] [--section.field VALUE ...]

Builds two trainers of `--config` in bf16 with the same seed and data, one with
`train.fp8=--recipe`, and alternates their steps so both see the same machine load; prints
each one's tokens/s (the median step's after the warm-up), the ratio fp8 / bf16, and the
largest relative difference of their per-step losses; the last line is one JSON object.

On CUDA (compute capability 8.9 or later: fp8 tensor cores) this is the speed figure. On a
CPU, which has no fp8 arithmetic, torch's `_scaled_mm` runs a reference kernel: the run is
labelled "CPU: no fp8 arithmetic, not a speed figure" and shows only that both paths run.
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


def _trainer(preset: str, overrides: list[str], run_dir: Path, steps: int, fp8: str
             ) -> Trainer:
    cfg = config.load(preset, ["--train.run_dir", str(run_dir), "--train.progress", "false",
                               "--train.steps", str(steps), "--train.precision", "bf16",
                               "--train.sample_tokens", "0", *overrides, "--train.fp8", fp8])
    cfg.validate(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Trainer(cfg, build_mesh(MeshShape(), rank=0, device=device), device)


def compare(preset: str, overrides: list[str], *, recipe: str, steps: int, warmup: int,
            run_dir: Path) -> dict:
    """bf16 and fp8 trainers of `preset`, steps alternated (module docstring)."""
    trainers = {mode: _trainer(preset, overrides, run_dir / mode, steps + warmup, fp8)
                for mode, fp8 in (("bf16", "none"), ("fp8", recipe))}
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    losses: dict[str, list[float]] = {mode: [] for mode in trainers}
    for i in range(warmup + steps):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            losses[mode].append(trainer.train_step()["loss"])  # its .item() ends the step
            if i >= warmup:
                times[mode].append(time.perf_counter() - start)
    tokens = trainers["bf16"].tokens_per_step
    rate = {mode: tokens / statistics.median(t) for mode, t in times.items()}
    device = trainers["bf16"].device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"preset": preset, "recipe": recipe, "overrides": overrides, "device": name,
            "label": ("speed figure" if device.type == "cuda"
                      else "CPU: no fp8 arithmetic, not a speed figure"),
            "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
            "bf16_tokens_per_s": rate["bf16"], "fp8_tokens_per_s": rate["fp8"],
            "ratio": rate["fp8"] / rate["bf16"],
            "worst_loss_deviation": max(abs(f - b) / abs(b) for b, f in
                                        zip(losses["bf16"], losses["fp8"])),
            # the mean of the last steps' losses (up to 5): single steps are noisier
            "final_loss_deviation": abs(statistics.fmean(losses["fp8"][-5:])
                                        / statistics.fmean(losses["bf16"][-5:]) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = compare(args.config, overrides, recipe=args.recipe, steps=args.steps,
                    warmup=args.warmup, run_dir=Path(tmp))
    print(f"{r['preset']} on {r['device']} ({r['label']}), {r['tokens_per_step']} tokens per "
          f"step, median of {r['steps']} steps after {r['warmup']} warm-up")
    print(f"bf16            {r['bf16_tokens_per_s']:10.0f} tokens/s")
    print(f"fp8 {r['recipe']:<11} {r['fp8_tokens_per_s']:10.0f} tokens/s  (x{r['ratio']:.2f})")
    print(f"worst relative per-step loss difference {r['worst_loss_deviation']:.1e}, over "
          f"the last 5 steps' mean {r['final_loss_deviation']:.1e}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
