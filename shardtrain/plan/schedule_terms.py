"""The planner's pipeline terms, from the schedule simulator (parallel/pipeline/simulate.py)
for every schedule: no closed form beside it that could drift.

- bubble_fraction: the idle share of the pipeline's time, mean over ranks;
- bubble_ratio: idle over busy time (for 1F1B (p-1)/m, interleaved (p-1)/(v m));
- in_flight: the most micro-batches whose activations a rank holds (the worst rank), in
  micro-batches of that rank's layers: from the schedule's order over all m micro-batches
  (GPipe's grows with m).

Costs F=1, B=2, W=1 (a backward does twice a forward's matmuls, half of them for the
weights): the fraction is scale-free, and the schedules the planner weighs differ only in
where the idle time falls. Beyond a few rounds of micro-batches every schedule repeats its
steady state, which has no idle time and holds no more activations, so the replay stops at
`_steady(p, v)` micro-batches and the steady state's busy time is added for the rest (a
test checks that this equals the full replay).
"""

from __future__ import annotations

from dataclasses import dataclass

from functools import lru_cache

from shardtrain.parallel.pipeline.schedules import compute_steps, peak_in_flight
from shardtrain.parallel.pipeline.simulate import Costs, simulate

PLAN_COSTS = Costs(f=1.0, b=2.0, w=1.0)


@dataclass(frozen=True)
class ScheduleTerms:
    bubble_fraction: float
    bubble_ratio: float
    in_flight: float


def _steady(p: int, v: int) -> int:
    """Micro-batches past which more only lengthen the steady state: four rounds of p (a
    multiple of p, as the interleaved schedule needs; at least the 2p of DualPipeV)."""
    return 4 * p


def default_schedule(v: int) -> str:
    """Callers that name no schedule: the one their chunk count implies."""
    return "interleaved" if v > 1 else "1f1b"


def schedule_terms(schedule: str, p: int, m: int, v: int = 1,
                   costs: Costs = PLAN_COSTS) -> ScheduleTerms:
    replay = min(m, _steady(p, v))
    sim = simulate(schedule, p, replay, v, costs)
    idle = sum(sim.idle) / len(sim.idle)
    busy = sim.span - idle  # per rank: the same work on every rank
    busy *= m / replay
    return ScheduleTerms(bubble_fraction=idle / (busy + idle), bubble_ratio=idle / busy,
                         in_flight=_in_flight(schedule, p, m, v))


@lru_cache(maxsize=512)
def _in_flight(schedule: str, p: int, m: int, v: int) -> float:
    steps = compute_steps(schedule, p, m, v)
    return max(peak_in_flight([a for step in rank for a in step]) for rank in steps) / v
