"""GPU check of FP8 linears (train.fp8, quant/float8.py): a model trained in one process in
bf16 and with each fp8 recipe, steps alternated (benchmarks/fp8_vs_bf16.py); the losses
must stay close, and tokens/s of each and their ratio are printed.

Sizes per device: on a GPU the default model, 20 timed steps after 3 of warm-up (torchao's
kernels: compute capability 8.9 or later); the CPU twin the tiny preset, 2 steps, where
torch's `_scaled_mm` runs its reference kernel (no speed figure, the same code path).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from parity import tiny_data

pytest.importorskip("torchao", reason="train.fp8 needs the fp8 extra (torchao)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fp8_vs_bf16 import compare  # noqa: E402

SIZES = {"cuda": ("default", 20, 3), "cpu": ("tiny", 2, 1)}  # preset, steps, warm-up steps
# fp8 against bf16: the mean loss of the last 5 steps within 2% (the acceptance's bound on
# the eval loss after 400 steps); single early steps, at the warm-up's largest updates,
# within 5% (the default model on CPU: 1.5e-2 worst over 10 steps, tensorwise)
BOUND, STEP_BOUND = 0.02, 0.05


@pytest.mark.slow_on_cpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_tokens_per_s(tmp_path, device, recipe, record_property):
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 or later (Ada, Hopper)")
    preset, steps, warmup = SIZES[device.type]
    r = compare(preset, ["--train.device", device.type, *tiny_data(tmp_path)], recipe=recipe,
                steps=steps, warmup=warmup, run_dir=tmp_path)
    print(f"\n{preset} model on {r['device']} ({r['label']}): bf16 {r['bf16_tokens_per_s']:.0f}"
          f" tokens/s, fp8 {recipe} {r['fp8_tokens_per_s']:.0f} (x{r['ratio']:.2f}), worst "
          f"loss deviation {r['worst_loss_deviation']:.1e}")
    for key in ("bf16_tokens_per_s", "fp8_tokens_per_s", "ratio", "worst_loss_deviation",
                "final_loss_deviation"):
        record_property(key, r[key])  # the GPU check's table (benchmarks/gpu/report.py)
    assert r["device"] == "cpu" if device.type == "cpu" else r["device"] != "cpu"
    assert 0 < r["worst_loss_deviation"] < STEP_BOUND  # fp8 computes, and stays close
    assert r["final_loss_deviation"] < BOUND
