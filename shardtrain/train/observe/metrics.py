"""Per-step metrics: metrics.jsonl, peak memory, MFU, optional TensorBoard (the model-state
memory ledger comes from Parallelized.memory)."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.data.fsutil import write_atomic
from shardtrain.model.moe import layer_balance, moe_stats, update_expert_biases
from shardtrain.train.observe.tracking import Tracker, scalars_of

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)

# Dense peak FLOP/s per GPU by the precision of its matmuls (vendor datasheets, SXM parts
# unless named; without sparsity), matched in order against the device name.
_GPU_PEAK = {
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
}


def matmul_precision(device: torch.device, precision: str) -> str:
    """The precision the run's matmuls use: train.precision, except that fp32 matmuls on a
    GPU run as tf32 when torch allows it (torch.set_float32_matmul_precision)."""
    if precision == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision.removesuffix("-true")  # bf16-true's matmuls are bf16's


def device_peak_flops(device: torch.device, configured: float,
                      precision: str = "fp32") -> float | None:
    """Peak FLOP/s of one device for the run's matmul precision (`matmul_precision`):
    `train.peak_flops` if set; the datasheet figure of a known GPU; None, with one warning,
    for a GPU not in the table (MFU is then reported as null); on CPU, the measured
    throughput of a large fp32 matmul on this process's threads (an achievable peak: CPUs
    publish no single figure)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = matmul_precision(device, precision)
        for key, peaks in _GPU_PEAK.items():
            if key in name:
                return peaks[kind]
        warnings.warn(f"unknown GPU {name!r}: no {kind} peak FLOP/s on file, so mfu is null in "
                      "metrics.jsonl; set train.peak_flops to the device's peak to get it",
                      stacklevel=2)
        return None
    return _cpu_peak(torch.get_num_threads())


@functools.cache
def _cpu_peak(threads: int) -> float:
    """Measured once per process and thread count: a trainer built again in the same
    process (tests, restarts in place) would otherwise pay ~0.3 s of its cores each time."""
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


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """`peak_mem_bytes`: on a GPU the CUDA caching allocator's peak of allocated bytes, on
    CPU this process's peak resident set size; `peak_reserved_bytes`: on a GPU the peak the
    allocator reserved from the driver (allocated plus its cache), None on CPU."""
    if device.type == "cuda":
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    peak = _proc_status("VmHWM")  # Linux: the high-water mark reset_peak_memory resets
    if peak is None:  # getrusage's also keeps the peaks of exited threads: no reset
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = rss if sys.platform == "darwin" else rss * 1024  # Linux: KiB
    return {"peak_mem_bytes": peak, "peak_reserved_bytes": None}


def _proc_status(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (None where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    except (OSError, StopIteration):
        return None


def reset_peak_memory(device: torch.device) -> int:
    """Start a new peak for `peak_memory` and return the memory in use now: on a GPU the
    allocator's counters; on Linux the process's high-water mark, reset through
    /proc/self/clear_refs (elsewhere, or where that is refused, the peak stays the
    process's since its start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one
    except OSError:
        pass
    return _proc_status("VmRSS") or 0


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """On glibc, serve every allocation of `nbytes` or more by mmap, so that freeing it
    returns it. glibc otherwise raises its threshold after a large free (up to 32 MiB) and
    serves the layers' activations from a heap that keeps freed pages resident: the
    process's RSS, the CPU dry run's measure, would count memory no tensor holds (0.8 GB of
    Llama-3-8B's backward). Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, nbytes)


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished the work queued so far (on CUDA the
    host runs ahead of the GPU: without the synchronisation a step time would be the time
    to launch its kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def read_records(path: Path) -> tuple[list[str], str]:
    """metrics.jsonl's lines, each one JSON object, and a note ("" if none) when its last
    line is torn -- cut short by a crash or a full disk during an append: dropped. A line
    that is not JSON anywhere else is no crash's doing (an append only ever touches the
    end): ConfigError naming the file and the line, before any process starts
    (train/start/prepare.py)."""
    if not path.exists():
        return [], ""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError as e:
            if number == len(lines):
                return lines[:-1], (f"{path}: its last line (line {number}) is torn, as a "
                                    "crash during an append leaves it; dropped")
            raise ConfigError(f"{path}:{number}: not a JSON record ({e}); the file was changed "
                              "by hand or damaged: repair or delete that line, or give another "
                              "train.run_dir") from None
    return lines, ""


class MetricsWriter:
    """Appends one JSON object per optimizer step to <run_dir>/metrics.jsonl (rank 0)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, resume: bool, from_step: int = 0,
                 trackers: Sequence[Tracker] = ()):
        """`resume`: keep the records of the steps up to `from_step` (the checkpoint's), drop
        later ones (an interrupted attempt's, redone now) and a torn last line, saying so;
        else start the file afresh. `trackers` (train/observe/tracking.py) receive every
        record too."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.trackers = list(trackers)
        if not enabled:
            return
        if not resume:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            lines, torn = read_records(self.path)
            if torn:
                print(torn, flush=True)
            kept = [line for line in lines if json.loads(line).get("step", 0) <= from_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, *records: dict[str, Any]) -> None:
        """Append `records` (steps in order: a flush reads several, train/pending.py) in one
        write call, so that a killed process leaves all or none of them; a failed write
        (a full disk) is cut back to the file's previous end before its error is raised.
        Only a power loss can still tear the last line, which a resume drops."""
        if not self.enabled or not records:
            return
        data = "".join(json.dumps(record) + "\n" for record in records).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            try:
                written = os.write(fd, data)
                while written < len(data):  # a regular file takes it whole but on error
                    written += os.write(fd, data[written:])
            except BaseException:
                os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)
        for record in records:
            for tracker in self.trackers:
                tracker.log(record["step"], scalars_of(record))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def moe_totals(module: torch.nn.Module, cfg: ModelConfig, mesh, device: torch.device
               ) -> torch.Tensor:
    """The step's mixture-of-experts totals (model/moe.py `moe_stats`) [6 + L (E + 1)],
    summed over this rank's MoE layers and micro-batches, then over the mesh's pipeline and
    replica groups (tag "metric"), so every rank (and rank 0, which writes) holds the whole
    model's over all replicas. Left on the device: `moe_fields` reads them at the flush
    (train/pending.py)."""
    total = moe_stats(module, cfg, device)
    for comm in (mesh.comm("pp"), mesh.comm(mesh.replica_dim)):
        comm.all_reduce(total, "sum", tag="metric")
    update_expert_biases(module, total)  # the step's whole load, the same on every replica
    return total


def moe_fields(total: list[float], cfg: ModelConfig) -> dict[str, Any]:
    """`moe_totals`, read: moe_aux_loss and moe_z_loss, the mean over layers, micro-batches
    and replicas; moe_dropped, the token-slots over capacity, in total; moe_expert_cv, the
    mean over layers and replicas of the coefficient of variation of one layer's routed
    counts per expert on one replica in the step; per layer (lists), moe_maxvio, the step's
    max load / mean load - 1 over all replicas, and moe_dropped_layers (None for a dense
    block)."""
    aux, z, forwards, dropped, cv, layers = total[:6]
    forwards, layers = max(forwards, 1.0), max(layers, 1.0)
    return {"moe_aux_loss": aux / forwards, "moe_z_loss": z / forwards,
            "moe_dropped": int(dropped), "moe_expert_cv": cv / layers,
            **layer_balance(total, cfg)}


def step_fields(read: list[float], cfg: ModelConfig) -> dict[str, Any]:
    """A step's optional fields, read after its loss and gradient norm: multi-token
    prediction's loss at each depth (`mtp_losses`, D values: model/mtp.py; `loss` is the
    main next-token loss), then the MoE totals (`moe_fields`)."""
    d = cfg.mtp_depth
    out: dict[str, Any] = {"mtp_losses": read[:d]} if d else {}
    return out | (moe_fields(read[d:], cfg) if cfg.n_experts else {})
