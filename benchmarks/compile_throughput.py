"""Compiled blocks against eager: training tokens/s of the same model and layout.

    python benchmarks/compile_throughput.py [--config default] [--steps 10] [--warmup 3]
                                            [--nproc 1] [--section.field VALUE ...]

Builds two trainers of `--config` (train.compile false and true) with the same seed and
data, in each of `--nproc` processes (the layout from the overrides, e.g. `--nproc 2
--parallel.tp 2`; timing from rank 0), and alternates their steps so both see the same
machine load: first
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

from teardown import run_then_leave
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local, pick_device
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer


def load(preset: str, overrides: list[str], run_dir: Path, steps: int, compiled: bool
         ) -> config.Config:
    return config.load(preset, ["--train.run_dir", str(run_dir), "--train.progress", "false",
                                "--train.steps", str(steps), *overrides, "--train.compile",
                                str(compiled).lower()])


def compare(preset: str, overrides: list[str], *, steps: int, warmup: int, run_dir: Path,
            info: ProcessInfo = ProcessInfo()) -> dict:
    """Eager and compiled trainers of `preset` on this rank of `info.world_size`, steps
    alternated (module docstring)."""
    trainers = {}
    for mode in ("eager", "compiled"):
        cfg = load(preset, overrides, run_dir / mode, steps + warmup, mode == "compiled")
        cfg.validate(info.world_size)
        device = pick_device(cfg.train.device, info)
        p = cfg.parallel
        shape = MeshShape(pp=p.pp, dp=p.resolved_dp(info.world_size), cp=p.cp, tp=p.tp,
                          ep=p.ep)
        trainers[mode] = Trainer(cfg, build_mesh(shape, rank=info.rank, device=device), device)
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
    return {"preset": preset, "overrides": overrides, "nproc": info.world_size,
            "device": str(trainers["eager"].device),
            "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
            "eager_tokens_per_s": rate["eager"], "compiled_tokens_per_s": rate["compiled"],
            "ratio": rate["compiled"] / rate["eager"],
            "compile_s": first["compiled"] - first["eager"],
            "worst_loss_deviation": deviation}


def worker(preset: str, overrides: list[str], steps: int, warmup: int, run_dir: str) -> dict:
    """One rank of a `--nproc` run: join the group, then compare (teardown.py: the exit
    without a hang)."""
    info = ProcessInfo.from_env()
    cfg = load(preset, overrides, Path(run_dir), steps, False)
    init_distributed(info, pick_device(cfg.train.device, info), cfg.comm.timeout_s)
    return run_then_leave(lambda: compare(preset, overrides, steps=steps, warmup=warmup,
                                          run_dir=Path(run_dir), info=info))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.nproc == 1:
            r = compare(args.config, overrides, steps=args.steps, warmup=args.warmup,
                        run_dir=Path(tmp))
        else:  # the worker by its module's name: launch_local hides __main__ from the ranks
            import compile_throughput

            r = launch_local(args.nproc, compile_throughput.worker, args.config, overrides,
                             args.steps, args.warmup, tmp)[0]
    print(f"{r['preset']} {' '.join(overrides)} on {r['nproc']} x {r['device']}, "
          f"{r['tokens_per_step']} tokens per step, median of {r['steps']} steps after "
          f"{r['warmup']} warm-up")
    print(f"eager    {r['eager_tokens_per_s']:10.0f} tokens/s")
    print(f"compiled {r['compiled_tokens_per_s']:10.0f} tokens/s  (x{r['ratio']:.2f}; "
          f"compile {r['compile_s']:.1f} s in the first step)")
    print(f"worst relative per-step loss difference {r['worst_loss_deviation']:.1e}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
