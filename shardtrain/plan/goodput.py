"""Goodput under failures (`shardtrain plan ... --mtbf-hours M`; docs/planner.md): useful
steps per hour, a useful step being one that trains on the full global batch, under
fault.mode = restart and under fault.mode = replicas.

Convention: M is one process's (one GPU's) mean time between failures, failures
independent, so a job of N processes fails at rate lambda = N / M (a node figure M_node
over nodes of g GPUs: pass M_node x g). First order in lambda x (time a failure costs):
two failures inside one recovery are not modelled, and a fraction below 0 is clamped.
T is the planned step time (the same layout for both modes).

restart (torchrun restarts every process; the job resumes from its newest checkpoint), a
save every C = checkpoint.every steps, each blocking the loop for S seconds:
    lost per failure  W = restart_s + load_s + (C T + S) / 2   (on average half an interval)
    useful fraction   f = C T / (C T + S) x (1 - lambda W)
Young's interval (Young 1974; Daly 2006 for its higher-order form), suggested: the time
between saves sqrt(2 S M / N), in steps round(sqrt(2 S M / N) / T).

replicas (R groups of N / R processes; torchft): a failure takes out one group, which
restarts (restart_s) and receives one rank's state from a live peer over the link
(transfer_s: params, master and optimizer state of one rank, in parallel across the
group's ranks). Meanwhile the survivors keep stepping on (R-1)/R of the global batch, and
the step in flight when the group fails is not committed and is taken again (T):
    lost per failure  W = T + (restart_s + transfer_s) / R     (in full-batch step time)
    useful fraction   f = 1 - lambda W                          (no saves)
Useful steps per hour = 3600 f / T in both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from shardtrain.plan.ops import placement

if TYPE_CHECKING:
    from shardtrain.plan.evaluate import Plan


@dataclass(frozen=True, kw_only=True)
class Goodput:
    mode: str  # restart or replicas
    useful_steps_per_hour: float
    ideal_steps_per_hour: float  # 3600 / T: no failure, no save
    fraction: float  # useful / ideal
    failures_per_hour: float  # lambda = N / M
    lost_per_failure_s: float  # W
    save_fraction: float = 0.0  # restart: S / (C T + S), the loop's time spent saving
    suggested_checkpoint_every: int = 0  # restart: Young's interval in steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def young_interval_s(save_s: float, mtbf_job_s: float) -> float:
    """Young's optimal time between checkpoints, sqrt(2 x save time x the job's MTBF)."""
    return math.sqrt(2 * save_s * mtbf_job_s)


def restart_goodput(*, step_s: float, processes: int, mtbf_hours: float, restart_s: float,
                    load_s: float, save_s: float, checkpoint_every: int) -> Goodput:
    """fault.mode = restart (module docstring); checkpoint_every 0: only the final save,
    every failure loses the run so far - the interval is then unbounded and goodput 0."""
    rate = processes / mtbf_hours  # failures per hour
    ideal = 3600 / step_s
    suggested = max(1, round(young_interval_s(save_s, 3600 * mtbf_hours / processes) / step_s))
    if checkpoint_every <= 0:
        return Goodput(mode="restart", useful_steps_per_hour=0.0, ideal_steps_per_hour=ideal,
                       fraction=0.0, failures_per_hour=rate, lost_per_failure_s=math.inf,
                       suggested_checkpoint_every=suggested)
    interval_s = checkpoint_every * step_s + save_s
    lost_s = restart_s + load_s + interval_s / 2
    saving = save_s / interval_s
    fraction = (1 - saving) * max(0.0, 1 - rate * lost_s / 3600)
    return Goodput(mode="restart", useful_steps_per_hour=ideal * fraction,
                   ideal_steps_per_hour=ideal, fraction=fraction, failures_per_hour=rate,
                   lost_per_failure_s=lost_s, save_fraction=saving,
                   suggested_checkpoint_every=suggested)


def replicas_goodput(*, step_s: float, processes: int, mtbf_hours: float, restart_s: float,
                     transfer_s: float, replicas: int) -> Goodput:
    """fault.mode = replicas over `replicas` >= 2 groups (module docstring)."""
    rate = processes / mtbf_hours
    ideal = 3600 / step_s
    lost_s = step_s + (restart_s + transfer_s) / replicas
    fraction = max(0.0, 1 - rate * lost_s / 3600)
    return Goodput(mode="replicas", useful_steps_per_hour=ideal * fraction,
                   ideal_steps_per_hour=ideal, fraction=fraction, failures_per_hour=rate,
                   lost_per_failure_s=lost_s)


def plan_goodput(plan: Plan, *, mtbf_hours: float, restart_s: float,
                 checkpoint_every: int | None, save_s: float | None = None,
                 load_s: float | None = None) -> dict[str, Any]:
    """Both modes' goodput for an evaluated layout, with the inputs used (checkpoint_every
    None: Young's interval). One rank's state
    (params, master, optimizer state, offloaded state: what a save writes and a rejoin
    receives) sets the defaults: save and load at the node's storage bandwidth shared by
    its GPUs (hw.nvme_bw / node; shared storage is often slower: give --save-s, --load-s),
    the transfer over the link between the replica groups' same-coordinate ranks."""
    lay, hw, mem = plan.layout, plan.hw, plan.memory
    node = hw.node_size(lay.gpus)
    state = mem.params + mem.master + mem.optimizer + mem.offloaded
    disk_s = state / (hw.nvme_bw / node)
    save_s, load_s = (disk_s if s is None else s for s in (save_s, load_s))
    link = placement(hw, node, lay.tp * lay.nd, max(2, lay.replicas)).link
    transfer_s = link.alpha_s + state * link.beta_s_per_byte
    step_s = plan.time.step_s
    young = young_interval_s(save_s, 3600 * mtbf_hours / lay.gpus)
    checkpoint_every = checkpoint_every or max(1, round(young / step_s))
    restart = restart_goodput(step_s=step_s, processes=lay.gpus, mtbf_hours=mtbf_hours,
                              restart_s=restart_s, load_s=load_s, save_s=save_s,
                              checkpoint_every=checkpoint_every)
    replicas = replicas_goodput(step_s=step_s, processes=lay.gpus, mtbf_hours=mtbf_hours,
                                restart_s=restart_s, transfer_s=transfer_s,
                                replicas=lay.replicas) if lay.replicas > 1 else None
    return {"inputs": {"mtbf_hours_per_process": mtbf_hours, "processes": lay.gpus,
                       "step_s": step_s, "restart_s": restart_s, "load_s": load_s,
                       "save_s": save_s, "checkpoint_every": checkpoint_every,
                       "state_bytes_per_rank": state, "transfer_s": transfer_s},
            "restart": restart.to_dict(),
            "replicas": replicas.to_dict() if replicas else None,
            "replicas_over_restart": replicas.useful_steps_per_hour /
            restart.useful_steps_per_hour if replicas and restart.useful_steps_per_hour
            else None}


def goodput_text(doc: dict[str, Any]) -> str:
    """The report's goodput lines."""
    i, r = doc["inputs"], doc["restart"]
    lines = [f"goodput at MTBF {i['mtbf_hours_per_process']:g} h per process x "
             f"{i['processes']} processes ({r['failures_per_hour']:.3g} failures/h), step "
             f"{i['step_s']:.3g} s, ideal {r['ideal_steps_per_hour']:.4g} steps/h:",
             f"  restart (checkpoint.every {i['checkpoint_every']}, save {i['save_s']:.3g} s, "
             f"load {i['load_s']:.3g} s, restart {i['restart_s']:.3g} s): "
             f"{r['useful_steps_per_hour']:.4g} useful steps/h ({r['fraction']:.1%}); Young's "
             f"interval: checkpoint.every {r['suggested_checkpoint_every']}"]
    if doc["replicas"]:
        p = doc["replicas"]
        lines.append(f"  replicas (transfer {i['transfer_s']:.3g} s): "
                     f"{p['useful_steps_per_hour']:.4g} useful steps/h ({p['fraction']:.1%})")
    else:
        lines.append("  replicas: needs parallel.replicas >= 2 (--replicas)")
    return "\n".join(lines)
