"""The planner against the runtime: the step time `shardtrain plan` predicts for the default
model on the `cpu` preset, calibrated on this machine, against the step time measured here.

    python benchmarks/plan_step_time.py [--steps 6]

Measures the machine's matmul throughput (as `shardtrain bench calibrate` does), writes it
to a temporary calibration, trains the default model for `--steps` steps in one process and
prints the best step after the first (the first warms up; best-of, as the calibration is)
against the planner's prediction, and their ratio. A figure, never a test: a step time on a
shared machine says how busy it was (it was a test until 2026-11-25, failing under load).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.cost import calibration, hardware
from shardtrain.mesh import MeshShape
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.layout import Layout
from shardtrain.train.start.calibrate import measure_compute
from shardtrain.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the tests and one process per core run
    peak, efficiency = measure_compute()
    with tempfile.TemporaryDirectory() as tmp:
        path = calibration.save(calibration.Calibration(
            flops_per_s=peak, efficiency=efficiency, alpha_s=calibration.DEFAULT.alpha_s,
            beta_s_per_byte=calibration.DEFAULT.beta_s_per_byte,
            gamma_s_per_byte=calibration.DEFAULT.gamma_s_per_byte,
            cores=torch.get_num_threads(), measured_at="benchmark"), Path(tmp) / "cal.json")
        cfg = config.load("default", ["--train.run_dir", str(Path(tmp) / "run"),
                                      "--data.cache_dir", str(Path(tmp) / "cache"),
                                      "--data.max_bytes", "2000000", "--train.progress", "false"])
        trainer = Trainer(cfg, build_mesh(MeshShape()), torch.device("cpu"))
        times = [trainer.train_step()["step_time_s"] for _ in range(args.steps)]
        t = cfg.train
        layout = Layout(dp=1, micro_batch=t.micro_batch, microbatches=t.accumulation_steps(1),
                        precision="fp32")
        predicted = evaluate(cfg.model, layout, hardware.get("cpu", calibration_path=path),
                             global_batch=t.global_batch, seq_len=t.seq_len).time.step_s
    measured = min(times[1:])
    print(f"default model step: measured {measured:.3f} s, predicted {predicted:.3f} s, "
          f"predicted / measured {predicted / measured:.2f} (peak {peak / 1e9:.0f} GFLOP/s, "
          f"efficiency {efficiency:.2f})")


if __name__ == "__main__":
    main()
