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
steady state, which adds no idle time and holds no more activations (GPipe: the same
number more each round), so the replay stops at `_steady(p)` micro-batches and the steady
state's busy time is added for the rest (a test checks that this equals the full replay).
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


def _steady(p: int) -> int:
    """Micro-batches past which more only lengthen the steady state: two rounds of p (a
    multiple of p, as the interleaved schedule needs; DualPipeV's least, 2p)."""
    return 2 * p


def default_schedule(v: int) -> str:
    """Callers that name no schedule: the one their chunk count implies."""
    return "interleaved" if v > 1 else "1f1b"


@lru_cache(maxsize=None)  # a search asks for the same few (schedule, p, m, v) many times
def schedule_terms(schedule: str, p: int, m: int, v: int = 1,
                   costs: Costs = PLAN_COSTS) -> ScheduleTerms:
    replay = min(m, _steady(p))
    sim = simulate(schedule, p, replay, v, costs)
    idle = sum(sim.idle) / len(sim.idle)
    busy = (sim.span - idle) * m / replay  # per rank: every rank does the same work
    # The worst rank's peak; past the steady point it stays (1F1B) or grows by the same
    # step every round of p micro-batches (GPipe): the order a round later extends it.
    peak = max(sim.peak_activations)
    if m > replay:
        later = max(peak_in_flight([a for step in rank for a in step])
                    for rank in compute_steps(schedule, p, replay + p, v)) / v
        peak += (m - replay) * (later - peak) / p
    return ScheduleTerms(bubble_fraction=idle / (busy + idle), bubble_ratio=idle / busy,
                         in_flight=peak)
