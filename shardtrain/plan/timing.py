"""Step time: compute, exposed communication, pipeline bubble; throughput, MFU and HFU.

    step = (compute + exposed pipeline comm) / (1 - bubble_fraction) + exposed dp comm
           + offload
- compute: the step's hardware FLOPs spread evenly over the GPUs at the achievable rate
  (peak x efficiency of the hardware preset).
- exposed communication: tp, pp and ep ops are on the critical path; cp's ring hides under
  compute; data-parallel gradient buckets hide under the last micro-batch's backward
  (once-per-step syncs) or under all compute (ZeRO-2/3 per-micro-batch traffic, ZeRO-3
  prefetch): exposed = max(0, comm - window) + one call (the first or last cannot hide).
  ZeRO-1/2's parameter all-gather after the optimizer step is exposed.
- bubble_fraction = (p-1)/(m+p-1), interleaved (p-1)/(v m + p-1), of the pipeline time
  (Narayanan et al. 2021); the bubble-to-ideal ratio (p-1)/m is `bubble_ratio`.
- offload: the gradient shard down and the parameter shard up over the host link, and for
  NVMe the optimizer state read and written once, all exposed (a conservative bound).
MFU = model FLOPs / (step x GPUs x peak); HFU the same with hardware FLOPs (FORMULAS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict

from shardtrain.plan.traffic import CommOp

_PIPELINE_GROUPS = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True, kw_only=True)
class StepTime:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_fraction: float
    bubble_ratio: float
    bubble_s: float
    offload_s: float
    tokens_per_s: float
    mfu: float
    hfu: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def bubble_fraction(p: int, m: int, *, v: int = 1) -> float:
    """Idle fraction of the pipeline's time; v > 1 for the interleaved schedule."""
    return (p - 1) / (v * m + p - 1)


def utilization(flops: float, step_s: float, gpus: int, peak_flops: float) -> float:
    """FLOPs done per step over what the GPUs could do at peak: MFU with model FLOPs, HFU
    with hardware FLOPs."""
    return flops / (step_s * gpus * peak_flops)


def exposed(ops: list[CommOp], *, compute_s: float, last_backward_s: float) -> tuple[float, float]:
    """(exposed seconds inside the pipeline, exposed seconds after it)."""
    buckets: dict[tuple[str, str], list[CommOp]] = {}
    for op in ops:
        buckets.setdefault((op.group, op.overlap), []).append(op)
    inside = outside = 0.0
    for (group, overlap), group_ops in buckets.items():
        total = sum(o.time_s for o in group_ops)
        if overlap == "none":
            hidden = total
        else:
            window = compute_s if overlap == "compute" else last_backward_s
            hidden = max(0.0, total - window) + max(o.time_s / o.calls for o in group_ops)
            hidden = min(hidden, total)
        if group in _PIPELINE_GROUPS:
            inside += hidden
        else:
            outside += hidden
    return inside, outside


def step_time(*, ops: list[CommOp], compute_s: float, last_backward_s: float, pp: int,
              microbatches: int, v: int, offload_s: float, tokens: int, model_flops: float,
              hardware_flops: float, gpus: int, peak_flops: float) -> StepTime:
    inside, outside = exposed(ops, compute_s=compute_s, last_backward_s=last_backward_s)
    bubble = bubble_fraction(pp, microbatches, v=v)
    pipeline_s = (compute_s + inside) / (1 - bubble)
    step = pipeline_s + outside + offload_s
    return StepTime(step_s=step, compute_s=compute_s, exposed_comm_s=inside + outside,
                    bubble_fraction=bubble, bubble_ratio=(pp - 1) / (v * microbatches),
                    bubble_s=pipeline_s * bubble, offload_s=offload_s,
                    tokens_per_s=tokens / step,
                    mfu=utilization(model_flops, step, gpus, peak_flops),
                    hfu=utilization(hardware_flops, step, gpus, peak_flops))


def training_seconds(total_flops: float, *, gpus: int, flops_per_gpu: float) -> float:
    return total_flops / (gpus * flops_per_gpu)


def gpus_for_deadline(total_flops: float, *, seconds: float, flops_per_gpu: float) -> int:
    """GPUs sustaining `flops_per_gpu` each that finish `total_flops` within `seconds`."""
    return math.ceil(total_flops / (seconds * flops_per_gpu))
