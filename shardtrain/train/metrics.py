"""Per-step metrics: metrics.jsonl, peak memory, MFU, optional TensorBoard (the model-state
memory ledger comes from Parallelized.memory)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Dense bf16 peak FLOP/s per GPU (vendor datasheets), matched against the device name.
_GPU_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "B200": 2250e12,
             "A100": 312e12}


def device_peak_flops(device: torch.device, configured: float) -> float:
    """Peak FLOP/s of one device: `train.peak_flops` if set; the datasheet figure of a known
    GPU; on CPU, the measured throughput of a large fp32 matmul on this process's threads
    (an achievable peak: CPUs publish no single figure)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK.items():
            if key in name:
                return flops
        raise ValueError(f"unknown GPU {name!r}: set train.peak_flops to its peak FLOP/s")
    return measure_matmul_flops()


def measure_matmul_flops(n: int = 512, trials: int = 5, seconds: float = 0.05) -> float:
    """Best-of-`trials` fp32 matmul throughput: other load on the machine only slows a
    trial down (a multi-threaded GEMM whose threads are descheduled can lose 10x), so the
    fastest trial is the closest to what this process can do."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up the kernels
    best = 0.0
    for _ in range(trials):
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            iters += 1
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    return best


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA peak allocated on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class MetricsWriter:
    """Appends one JSON object per optimizer step to <run_dir>/metrics.jsonl (rank 0)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, tensorboard: bool, resume: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        if not resume:
            self.path.unlink(missing_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional extra
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
