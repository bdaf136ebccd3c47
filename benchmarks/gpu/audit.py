"""Part 4 of the GPU check: a profiler audit of the default model's training step.

    python benchmarks/gpu/audit.py --device cuda --rows ROWS.jsonl [--cache DIR]

For bf16 and fp32, one process trains 6 steps with `train.profile_steps = 3:5` (steps 3 to
5: warmed up, none of them logged, evaluated or saved) and reads its Chrome trace: per step,
the host waits on the device (CUDA's stream, event and device synchronisations, and the
device-to-host value reads, `aten::_local_scalar_dense`), the copies from pageable host
memory (each a host wait of its own), the attention operators and kernels that ran (which
SDPA backend: flash, memory-efficient, cuDNN or the math fallback that materialises the
scores), with the step time and MFU of the run's records. On a CPU (`--device cpu`, the
twin) the tiny preset, and only the value reads and operators mean anything.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from harness import one_process, part_main, run_config

PRESETS = {"cuda": "default", "cpu": "tiny"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
ATTENTION = ("scaled_dot_product", "flash", "fmha", "attention", "sdpa")  # op and kernel names


def trace_audit(trace: dict, steps: int) -> dict:
    """What a Chrome trace of `steps` steps (train/observe/profile.py) holds, per step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = Counter(e.get("name", "") for e in events)
    kernels = [e.get("name", "") for e in events if e.get("cat") == "kernel"]
    copies = [e.get("name", "") for e in events if e.get("cat") == "gpu_memcpy"]
    attention = sorted({n for n in names if n.startswith("aten::") and
                        any(a in n.lower() for a in ATTENTION)} |
                       {_short(n) for n in kernels if any(a in n.lower() for a in ATTENTION)})
    return {"steps_traced": sorted(n for n in names if n.startswith("step ")),
            "syncs_per_step": sum(names[c] for c in SYNC_CALLS) / steps,
            "value_reads_per_step": names["aten::_local_scalar_dense"] / steps,
            "pageable_copies_per_step": sum("Pageable" in c for c in copies) / steps,
            "kernels_per_step": len(kernels) / steps,
            "attention": attention}


def _short(kernel: str) -> str:
    """A kernel's name without its template arguments."""
    return kernel.split("<")[0].split("(")[0].strip()


def audit(device, precision: str, run_dir: Path, cache: str | None) -> dict:
    cfg = run_config(PRESETS[device.type], run_dir, device, "--train.precision", precision,
                     "--train.steps", "6", "--train.profile_steps", "3:5",
                     "--train.log_every", "100", "--train.eval_every", "0",
                     "--train.sample_tokens", "0", cache_dir=cache)
    result = one_process(cfg, device).run()
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    traced = result.history[2:5]
    return {**trace_audit(trace, 3), "preset": PRESETS[device.type],
            "ms_per_step": statistics.median(r["step_time_s"] for r in traced) * 1e3,
            "mfu": traced[-1]["mfu"]}


def main() -> None:
    device, rows, args = part_main(__doc__, "audit", cache=True)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("bf16", "fp32"):
            rows.guarded(f"{PRESETS[device.type]} {precision}",
                         lambda: audit(device, precision, Path(tmp) / precision, args.cache))


if __name__ == "__main__":
    main()
