"""GPU checks: the default model trained in one process on a CUDA device in fp32, bf16 and
fp16, ZeRO-3 with cpu and nvme offload at dp=1, activation checkpointing, a checkpoint save
and resume. Each run must finish with finite losses; bf16 must end within 2% of the CPU fp32
eval loss. They print step time, MFU and peak memory (allocated and reserved).

Run where CUDA exists: `python -m pytest tests/gpu -q -s`. Elsewhere every test is skipped
(the reason says so); the CPU suite has its own checks of what a CPU can catch.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from parity import tiny
from shardtrain import config
from shardtrain.mesh import MeshShape, ParallelMesh
from shardtrain.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these checks train on a GPU")

STEPS = 200  # of shardtrain/configs/default.toml's model and batch: a minute or so on one GPU


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu")


def _cfg(tmp, name: str, *overrides: str):
    base = tiny(tmp, name)  # run dir and token cache under tmp
    return config.load("default", ["--train.run_dir", base.train.run_dir, "--data.cache_dir",
                                   base.data.cache_dir, "--train.progress", "false",
                                   "--train.steps", str(STEPS), "--train.eval_every", "0",
                                   "--train.sample_tokens", "0", *overrides])


def _train(cfg, device: str) -> tuple[float, list[dict]]:
    cfg.validate(1)
    trainer = Trainer(cfg, ParallelMesh(MeshShape()), torch.device(device))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = trainer.run()
    return result.eval_loss, result.history


def _report(label: str, eval_loss: float, history: list[dict]) -> None:
    times = [r["step_time_s"] for r in history[len(history) // 2:]]  # warmed up
    mfu = history[-1]["mfu"]
    print(f"{label:>22}: eval loss {eval_loss:.4f}, step {statistics.median(times) * 1e3:.1f} ms "
          f"(median of the last {len(times)}), MFU "
          f"{'n/a' if mfu is None else f'{mfu:.1%}'}, peak allocated "
          f"{history[-1]['peak_mem_bytes'] / 2**20:.0f} MiB, reserved "
          f"{history[-1]['peak_reserved_bytes'] / 2**20:.0f} MiB, skipped "
          f"{sum(r['skipped'] for r in history)}")
    assert all(math.isfinite(r["loss"]) for r in history if not r["skipped"]), label
    assert math.isfinite(eval_loss), label


@pytest.fixture(scope="module")
def cpu_fp32(tmp) -> float:
    eval_loss, _ = _train(_cfg(tmp, "cpu-fp32", "--train.device", "cpu"), "cpu")
    print(f"\n{'cpu fp32':>22}: eval loss {eval_loss:.4f}")
    return eval_loss


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_default_model_on_gpu(tmp, cpu_fp32, precision):
    eval_loss, history = _train(_cfg(tmp, f"gpu-{precision}", "--train.precision", precision),
                                "cuda")
    _report(f"gpu {precision}", eval_loss, history)
    if precision == "bf16":
        assert abs(eval_loss - cpu_fp32) <= 0.02 * cpu_fp32, (eval_loss, cpu_fp32)
    if precision == "fp16":
        assert history[-1]["loss_scale"] >= 1.0


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_zero3_offload_on_gpu(tmp, offload):
    extra = ["--parallel.offload_dir", str(tmp)] if offload == "nvme" else []
    eval_loss, history = _train(_cfg(tmp, f"gpu-zero3-{offload}", "--parallel.zero", "3",
                                     "--parallel.offload", offload, "--train.precision", "bf16",
                                     *extra), "cuda")
    _report(f"gpu zero3 {offload} offload", eval_loss, history)
    assert history[-1]["offloaded_bytes"] > 0


def test_activation_checkpointing_on_gpu(tmp):
    eval_loss, history = _train(_cfg(tmp, "gpu-ac", "--train.activation_checkpointing", "full",
                                     "--train.precision", "bf16"), "cuda")
    _report("gpu bf16 checkpointed", eval_loss, history)


@pytest.mark.parametrize("zero", ["0", "3"])
def test_checkpoint_save_and_resume_on_gpu(tmp, zero):
    """Half the steps, save, resume in a new trainer, the other half. The first resumed
    step's loss (a forward of the restored weights on the restored sampler's batch) equals
    the one the saving trainer computes next; the resumed run ends within 2% of a straight
    run's eval loss (backward kernels with atomics are not bitwise deterministic on GPU, so
    the two runs' later steps are not compared exactly)."""
    layout = ["--parallel.zero", zero, "--train.precision", "bf16"]
    if zero == "3":
        layout += ["--parallel.offload", "cpu"]
    straight, _ = _train(_cfg(tmp, f"gpu-straight-z{zero}", *layout), "cuda")
    cfg = _cfg(tmp, f"gpu-split-z{zero}", *layout)
    first = Trainer(cfg, ParallelMesh(MeshShape()), torch.device("cuda"))
    for _ in range(STEPS // 2):
        first.train_step()
    first.save()
    next_loss = first.train_step()["loss"]
    del first
    torch.cuda.empty_cache()
    eval_loss, resumed = _train(_cfg(tmp, f"gpu-split-z{zero}", *layout,
                                     "--checkpoint.resume", "latest"), "cuda")
    _report(f"gpu resumed zero{zero}", eval_loss, resumed)
    assert [r["step"] for r in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    assert resumed[0]["loss"] == pytest.approx(next_loss, rel=1e-6)
    assert abs(eval_loss - straight) <= 0.02 * straight, (eval_loss, straight)
