"""GPU check of compiled blocks (train.compile): a model trained in one process on the
device, eager and compiled, steps alternated (benchmarks/compile_throughput.py); the losses
must agree, and the tokens/s of each and their ratio are printed.

Sizes per device: on a GPU the default model, 20 timed steps, compiled by inductor; the CPU
twin the tiny preset, 2 steps, compiled as harness.COMPILE_BACKEND says.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness import compile_backend
from parity import tiny_data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compile_throughput import compare  # noqa: E402

SIZES = {"cuda": ("default", 20, 3), "cpu": ("tiny", 2, 1)}  # preset, steps, warm-up steps


@pytest.mark.slow_on_cpu  # dynamo's first traces: ~15-30 s on a busy 2-core machine
def test_compiled_tokens_per_s(tmp_path, device, record_property):
    preset, steps, warmup = SIZES[device.type]
    with compile_backend(device) as backend:
        r = compare(preset, ["--train.device", device.type, "--train.precision", "fp32",
                             *tiny_data(tmp_path)], steps=steps, warmup=warmup, run_dir=tmp_path)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{preset} model on {name} ({backend}): eager {r['eager_tokens_per_s']:.0f} "
          f"tokens/s, compiled {r['compiled_tokens_per_s']:.0f} (x{r['ratio']:.2f}), compile "
          f"{r['compile_s']:.1f} s")
    for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "ratio", "compile_s"):
        record_property(key, r[key])  # the GPU check's table (benchmarks/gpu/report.py)
    assert r["device"].startswith(device.type)
    # fp32: inductor's fused kernels reorder sums, which 23 steps of training amplify (and a
    # GPU's fp32 matmuls may round to TF32: 2e-3 allows that).
    assert r["worst_loss_deviation"] < 2e-3
