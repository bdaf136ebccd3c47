"""The load-balancing loss at work: the tiny preset with experts, trained with the Switch
aux loss on and off; prints the coefficient of variation (std / mean) of the per-expert
routed token counts (metrics.jsonl's moe_expert_cv) at the start and the end, and a JSON line.

    python benchmarks/moe_balance.py [--steps 150 --experts 8 --coef 0.01]
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


def run(coef: float, args: argparse.Namespace, tmp: Path) -> list[float]:
    cfg = config.load("tiny", ["--train.run_dir", str(tmp / f"coef{coef}"),
                               "--data.cache_dir", str(tmp / "cache"), "--train.progress", "false",
                               "--train.steps", str(args.steps), "--model.n_experts",
                               str(args.experts), "--model.moe_aux_loss_coef", str(coef),
                               "--checkpoint.every", "0"])
    trainer = Trainer(cfg, build_mesh(MeshShape(), rank=0), torch.device("cpu"))
    return [r["moe_expert_cv"] for r in trainer.run().history]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--coef", type=float, default=0.01)
    args = p.parse_args()
    last = 10  # the end: the mean over the last 10 steps
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for coef in (args.coef, 0.0):
            cv = run(coef, args, Path(tmp))
            out[f"coef={coef}"] = {"cv_first": cv[0], "cv_end": sum(cv[-last:]) / last}
            print(f"aux coef {coef}: expert-count CV step 1 {cv[0]:.3f}, "
                  f"mean of the last {last} steps {out[f'coef={coef}']['cv_end']:.3f}")
    print(json.dumps({**vars(args), **out}))


if __name__ == "__main__":
    main()
