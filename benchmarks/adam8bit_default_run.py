"""The default run's eval loss with AdamW, shardtrain's AdamW8bit and bitsandbytes'.

Each optimizer trains the default run in one process on the same batches; bitsandbytes'
own AdamW8bit (the reference implementation) where that package is installed.

    python benchmarks/adam8bit_default_run.py [--optimizers adamw,adamw8bit,bitsandbytes]
                                              [--section.field VALUE ...]

`bitsandbytes` (`pip install bitsandbytes`; 0.50 runs its 8-bit optimizers on CPU) takes
the place of shardtrain's AdamW8bit with the same parameter groups, betas, eps, weight
decay, 4096-element threshold and blocks of 256. Printed per optimizer: the eval loss on
train.eval_batches batches (what the run prints), on the whole held-out split, the mean
training loss of the last 50 steps, and each one's gap to AdamW's. A figure, never a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
import torch.distributed as dist

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer


@contextmanager
def one_process_trainer(overrides: list[str]) -> Iterator[Trainer]:
    """The default run's trainer in this process (a one-rank gloo group), with `overrides`."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            cfg = config.load("default", ["--train.run_dir", f"{tmp}/run", "--train.progress",
                                          "false", "--train.sample_tokens", "0", *overrides])
            mesh = build_mesh(MeshShape(pp=1, dp=1, cp=1, tp=1, ep=1), rank=0, node_size=1,
                              algorithm=cfg.comm.algorithm, timeout_s=cfg.comm.timeout_s)
            yield Trainer(cfg, mesh, torch.device("cpu"))
        finally:
            dist.destroy_process_group()


def bitsandbytes_adamw8bit(groups: list[dict], lr: float, betas: tuple[float, float],
                           eps: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # optional: only this row needs it

    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps, min_8bit_size=4096)


def measure(optimizer: str, overrides: list[str]) -> dict[str, float]:
    name = "adamw8bit" if optimizer == "bitsandbytes" else optimizer
    patch = (mock.patch("shardtrain.train.optim.AdamW8bit", bitsandbytes_adamw8bit)
             if optimizer == "bitsandbytes" else nullcontext())
    with patch, one_process_trainer(["--optim.name", name, *overrides]) as trainer:
        t = trainer.cfg.train
        losses = [trainer.train_step()["loss"] for _ in range(t.steps)]
        whole = len(trainer.data.eval) // (t.seq_len * t.micro_batch)  # batches in the split
        return {"eval": trainer.evaluate(), "eval_whole": trainer.evaluate(whole),
                "train_last50": sum(losses[-50:]) / len(losses[-50:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="adamw,adamw8bit,bitsandbytes")
    args, overrides = parser.parse_known_args()
    optimizers = args.optimizers.split(",")
    unknown = set(optimizers) - {"adamw", "adamw8bit", "bitsandbytes"}
    if unknown:
        parser.error(f"--optimizers: {', '.join(sorted(unknown))} unknown; choose among "
                     "adamw, adamw8bit, bitsandbytes")
    if "bitsandbytes" in optimizers and importlib.util.find_spec("bitsandbytes") is None:
        parser.error("--optimizers bitsandbytes needs the bitsandbytes package: "
                     "pip install bitsandbytes, or leave it out of --optimizers")
    rows = {opt: measure(opt, overrides) for opt in optimizers}
    base = rows.get("adamw")
    print(f"{'optimizer':>12}  {'eval loss':>17}  {'whole split':>17}  {'train, last 50':>17}")
    for opt, r in rows.items():
        cells = [f"{r[k]:.4f}" + (f" ({r[k] / base[k] - 1:+.2%})" if base and opt != "adamw"
                                  else "") for k in ("eval", "eval_whole", "train_last50")]
        print(f"{opt:>12}  " + "  ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
