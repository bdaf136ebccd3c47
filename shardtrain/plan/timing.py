"""Step time: compute, exposed communication, pipeline bubble; throughput, MFU and HFU.

    step = (compute + exposed pipeline comm) / (1 - bubble_fraction) + exposed dp comm
           + optimizer + offload
- compute: the forward and backward's ops on one rank, each at the roofline's max(FLOPs /
  (peak x efficiency), bytes / memory bandwidth) (plan/roofline.py): the linears and the
  attention core carry the step's hardware FLOPs spread evenly over the GPUs; norms,
  residual adds, activation functions, rotary, an unfused softmax, the embedding and the
  loss's softmax their bytes. `compute_bound_s` and `memory_bound_s` split compute +
  optimizer by the ceiling that set each op's time.
- optimizer: the optimizer step on the rank's shard, memory-bound, after the pipeline
  (none under offload: the host runs it).
- exposed communication: tp, pp and ep ops are on the critical path; cp's ring and ZeRO-3's
  prefetched all-gathers hide under all compute; gradient buckets hide under the last
  micro-batch's backward (once-per-step syncs) or under every backward (ZeRO-2/3
  reduce-scatters each micro-batch): per group, exposed = max(0, comm - window) + one call
  (the first or last cannot hide). ZeRO-1/2's all-gather after the optimizer step is exposed.
- bubble_fraction: the idle share of the pipeline time, from the schedule simulator
  (plan/schedule_terms.py): (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p-1)
  interleaved (Narayanan et al. 2021), less for the zero-bubble schedules; the
  bubble-to-ideal ratio ((p-1)/m for 1F1B) is `bubble_ratio`.
- offload: the gradient shard down and the parameter shard up over the host link, and for
  NVMe the optimizer state read and written once, all exposed (a conservative bound).
MFU = model FLOPs / (step x GPUs x peak); HFU the same with hardware FLOPs (FORMULAS.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shardtrain.plan.roofline import RoofOp, split
from shardtrain.plan.schedule_terms import default_schedule, schedule_terms
from shardtrain.plan.traffic import CommOp

_PIPELINE_GROUPS = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True, kw_only=True)
class StepTime:
    step_s: float
    compute_s: float  # forward + backward ops (roofline), before the bubble
    compute_bound_s: float  # of compute + optimizer: ops whose FLOPs set their time
    memory_bound_s: float  # of compute + optimizer: ops whose bytes set their time
    optimizer_s: float
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


def bubble_fraction(p: int, m: int, *, v: int = 1, schedule: str | None = None) -> float:
    """Idle fraction of the pipeline's time (schedule None: 1F1B, interleaved if v > 1)."""
    return schedule_terms(schedule or default_schedule(v), p, m, v).bubble_fraction


def utilization(flops: float, step_s: float, gpus: int, peak_flops: float) -> float:
    """FLOPs done per step over what the GPUs could do at peak: MFU with model FLOPs, HFU
    with hardware FLOPs."""
    return flops / (step_s * gpus * peak_flops)


def exposed(ops: list[CommOp], *, compute_s: float, backward_s: float,
            last_backward_s: float) -> tuple[float, float]:
    """(exposed seconds inside the pipeline, exposed seconds after it). A group's ops share
    its links: what hides is bounded by each window and by the widest one."""
    windows = {"compute": compute_s, "backward": backward_s, "step": last_backward_s}
    groups: dict[str, list[CommOp]] = {}
    for op in ops:
        groups.setdefault(op.group, []).append(op)
    inside = outside = 0.0
    for group, group_ops in groups.items():
        seconds = sum(o.time_s for o in group_ops if o.overlap == "none")
        per_window: dict[str, float] = {}
        for o in group_ops:
            if o.overlap != "none":
                per_window[o.overlap] = per_window.get(o.overlap, 0.0) + o.time_s
        if per_window:
            hideable = sum(per_window.values())
            late = max(sum(max(0.0, t - windows[w]) for w, t in per_window.items()),
                       hideable - max(windows[w] for w in per_window))
            last_call = max(o.time_s / o.calls for o in group_ops if o.overlap != "none")
            seconds += min(hideable, late + last_call)
        if group in _PIPELINE_GROUPS:
            inside += seconds
        else:
            outside += seconds
    return inside, outside


def step_time(*, ops: list[CommOp], roof: list[RoofOp], backward_share: float, pp: int,
              microbatches: int, v: int, offload_s: float, tokens: int, model_flops: float,
              hardware_flops: float, gpus: int, peak_flops: float,
              schedule: str | None = None) -> StepTime:
    """Compose the step (module docstring); backward_share: backward's part of compute."""
    compute_s = sum(o.time_s for o in roof if o.in_pipeline)
    optimizer_s = sum(o.time_s for o in roof if not o.in_pipeline)
    compute_bound, memory_bound = split(roof)
    backward_s = compute_s * backward_share
    inside, outside = exposed(ops, compute_s=compute_s, backward_s=backward_s,
                              last_backward_s=backward_s / microbatches)
    terms = schedule_terms(schedule or default_schedule(v), pp, microbatches, v)
    bubble = terms.bubble_fraction
    pipeline_s = (compute_s + inside) / (1 - bubble)
    step = pipeline_s + outside + optimizer_s + offload_s
    return StepTime(step_s=step, compute_s=compute_s, compute_bound_s=compute_bound,
                    memory_bound_s=memory_bound, optimizer_s=optimizer_s,
                    exposed_comm_s=inside + outside,
                    bubble_fraction=bubble, bubble_ratio=terms.bubble_ratio,
                    bubble_s=pipeline_s * bubble, offload_s=offload_s,
                    tokens_per_s=tokens / step,
                    mfu=utilization(model_flops, step, gpus, peak_flops),
                    hfu=utilization(hardware_flops, step, gpus, peak_flops))


def training_seconds(total_flops: float, *, gpus: int, flops_per_gpu: float) -> float:
    """Wall time of `total_flops` on `gpus` GPUs sustaining `flops_per_gpu` each: with
    training_flops, the rule 6TP/(nX) (8TP/(nX) with full recomputation)."""
    return total_flops / (gpus * flops_per_gpu)


def gpus_for_deadline(total_flops: float, *, seconds: float, flops_per_gpu: float) -> int:
    """GPUs sustaining `flops_per_gpu` each that finish `total_flops` within `seconds`."""
    return math.ceil(total_flops / (seconds * flops_per_gpu))
