"""What a checkpoint costs the step loop: mean step time with no save, with a synchronous
save every `--every` steps and with an asynchronous one, on one process, same model.

    python benchmarks/checkpoint_save.py [--config default] [--device cpu|cuda]
                                         [--every 2 --blocks 3 --block-steps 4]
                                         [--precision fp32 --zero 0 --offload none]

The three modes run in alternating blocks of `--block-steps` steps on one trainer (so
machine noise hits them alike); a block's time runs from its first step's start until its
last save is written (an asynchronous save is waited for at the block's end, so its cost
is not pushed into the next block). Prints each mode's mean time per step, the ratios to
no saving, the state size and the synchronous write rate, a markdown row and one JSON
line. A figure, never a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.observe.metrics import clock
from shardtrain.train.checkpoint.saver import Saver
from shardtrain.train.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--block-steps", type=int, default=4)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--zero", default="0")
    p.add_argument("--offload", default="none")
    args = p.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config.load(args.config, [
            "--train.run_dir", run_dir, "--train.steps", "100000", "--train.progress", "false",
            "--train.precision", args.precision, "--parallel.zero", args.zero,
            "--parallel.offload", args.offload, "--checkpoint.keep", "1"])
        cfg.validate(1)
        trainer = Trainer(cfg, build_mesh(MeshShape(), rank=0), device)
        savers = {mode: Saver(dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, async_save=mode == "async")), trainer.mesh)
            for mode in ("sync", "async")}
        times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        trainer.train_step()  # warm-up
        for _ in range(args.blocks):
            for mode in times:
                start = clock(device)
                for i in range(args.block_steps):
                    trainer.train_step()
                    if mode != "none" and (i + 1) % args.every == 0:
                        trainer.saver = savers[mode]
                        trainer.save()
                if mode == "async":
                    savers[mode].wait()
                times[mode].append((clock(device) - start) / args.block_steps)
        t0 = time.perf_counter()
        savers["sync"].save(trainer.step, trainer.parallel, sampler_state={}, layout={},
                            tokenizer_file=None)
        write_s = time.perf_counter() - t0
        pieces, _ = trainer.parallel.state_pieces()
        state = sum(p.region.numel * torch.empty((), dtype=p.dtype).element_size()
                    for p in pieces)
    mean = {mode: statistics.mean(v) for mode, v in times.items()}
    label = (f"{args.config}, {args.precision}, zero {args.zero}, offload {args.offload}, "
             f"save every {args.every} steps, {args.device}")
    print(f"checkpoint cost per step: {label}; state {state / 2**20:.0f} MiB, synchronous "
          f"save {write_s:.2f} s ({state / 2**20 / write_s:.0f} MiB/s)")
    for mode, t in mean.items():
        print(f"{mode:>5}: {t * 1e3:8.1f} ms/step  ({t / mean['none']:.2f}x no saving)")
    print(f"| {label} | {state / 2**20:.0f} MiB | {mean['none'] * 1e3:.0f} ms | "
          f"{mean['sync'] / mean['none']:.2f}x | {mean['async'] / mean['none']:.2f}x |")
    print(json.dumps({**vars(args), "state_bytes": state, "save_s": write_s,
                      **{f"{m}_s_per_step": t for m, t in mean.items()}}))


if __name__ == "__main__":
    main()
