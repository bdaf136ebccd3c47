"""The planner against the runtime: the step time it predicts for the default model on the
`cpu` preset, calibrated on this machine, is within 25% of the measured step time.
(Model-state and communication bytes are checked exactly in test_dp.py's DP spawn.)"""

import torch

from parity import tiny
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.cost import calibration, hardware
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.layout import Layout
from shardtrain.train.calibrate import measure_compute
from shardtrain.train.trainer import Trainer


def test_predicted_step_time_of_the_default_model(tmp_path):
    peak, efficiency = measure_compute()
    path = calibration.save(calibration.Calibration(
        flops_per_s=peak, efficiency=efficiency, alpha_s=calibration.DEFAULT.alpha_s,
        beta_s_per_byte=calibration.DEFAULT.beta_s_per_byte,
        gamma_s_per_byte=calibration.DEFAULT.gamma_s_per_byte, cores=torch.get_num_threads(),
        measured_at="test"), tmp_path / "cal.json")
    base = tiny(tmp_path, "default")  # run dir and cache under tmp_path
    cfg = config.load("default", ["--train.run_dir", base.train.run_dir, "--data.cache_dir",
                                  base.data.cache_dir, "--data.max_bytes", "2000000",
                                  "--train.progress", "false"])
    trainer = Trainer(cfg, build_mesh(MeshShape()), torch.device("cpu"))
    times = [trainer.train_step()["step_time_s"] for _ in range(6)]
    measured = min(times[1:])  # the first step warms up; best-of, as the calibration is
    t = cfg.train
    layout = Layout(dp=1, micro_batch=t.micro_batch, microbatches=t.accumulation_steps(1),
                    precision="fp32")
    predicted = evaluate(cfg.model, layout, hardware.get("cpu", calibration_path=path),
                         global_batch=t.global_batch, seq_len=t.seq_len).time.step_s
    print(f"default model step: measured {measured:.3f} s, predicted {predicted:.3f} s "
          f"(peak {peak / 1e9:.0f} GFLOP/s, efficiency {efficiency:.2f})")
    assert abs(predicted / measured - 1) < 0.25
