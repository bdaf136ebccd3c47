"""GPU checks of the default model's numbers: trained in one process on the device in fp32,
bf16 and fp16; every step's loss finite, the eval loss within 2% of the CPU's fp32 run of
the same config (REFERENCE, stored), fp16's loss scale sane. Each prints its step time, MFU
and peak memory (allocated and reserved).

Sizes per device: on a GPU the default preset for 100 steps (a few seconds each on an
H100); the CPU twin (the CPU suite, `--device cpu`) the tiny preset for 3 steps. Offload,
recompute, checkpoints and the other features run in test_gpu_checkpoint.py and the GPU
check's sweep (benchmarks/gpu/sweep.py).

    python tests/gpu/test_gpu.py PRESET STEPS    # prints the CPU fp32 reference of a size
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # as a script: the harness beside the check (conftest.py's path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
from harness import figures, one_process, run_config, summary  # noqa: E402

SIZES = {"cuda": ("default", 100), "cpu": ("tiny", 3)}  # device -> (preset, steps)
# The CPU fp32 eval loss of each size: `python tests/gpu/test_gpu.py PRESET STEPS` (one
# thread; torch 2.13.0+cpu, 2026-11-26). Stored, not computed: 100 steps of the default
# model take minutes on a CPU. A GPU's fp32 and a CPU's differ in summation order only.
REFERENCE = {("default", 100): 2.3611, ("tiny", 3): 5.0273}
BOUND = 0.02  # relative: bf16 and fp16 rounding over 100 steps, measured well inside it


def _cfg(run_dir: Path, size: tuple[str, int], device: torch.device, cache_dir: str,
         *overrides: str):
    preset, steps = size
    return run_config(preset, run_dir, device, "--train.steps", str(steps),
                      "--train.eval_every", "0", "--train.sample_tokens", "0",
                      "--train.log_every", "50", *overrides, cache_dir=cache_dir)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_default_model_numbers(tmp_path, device, precision, record_property):
    from parity import tiny_data  # the test session's token cache (tests/conftest.py)

    cfg = _cfg(tmp_path / "run", SIZES[device.type], device, tiny_data(tmp_path)[1],
               "--train.precision", precision)
    trainer = one_process(cfg, device)
    result = trainer.run()
    fig = figures(result.history)
    reference = REFERENCE[SIZES[device.type]]
    print(f"\n{device.type} {precision}: eval loss {result.eval_loss:.4f} (CPU fp32 "
          f"{reference}), {summary(fig)}")
    for name, value in {"eval_loss": result.eval_loss, **fig}.items():
        if value is not None:  # the GPU check's table (benchmarks/gpu/report.py)
            record_property(name, value)
    assert all(math.isfinite(r["loss"]) for r in result.history if not r["skipped"]), \
        result.losses
    assert abs(result.eval_loss - reference) <= BOUND * reference, (result.eval_loss, reference)
    if precision == "fp16":
        assert result.history[-1]["loss_scale"] >= 1.0


def reference(preset: str, steps: int) -> float:
    """The CPU fp32 eval loss of a size, as REFERENCE stores it."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _cfg(Path(tmp) / "ref", (preset, steps), torch.device("cpu"), f"{tmp}/cache")
        return one_process(cfg, torch.device("cpu")).run().eval_loss


if __name__ == "__main__":
    print(f"{reference(sys.argv[1], int(sys.argv[2])):.4f}")
