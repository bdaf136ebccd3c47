"""Replay a schedule with given costs: per-rank timelines, idle time, bubble, activations.

Each rank runs its compute steps (schedules.py) in order, each as soon as the rank is free
and its inputs exist: a forward of virtual stage g after the same micro-batch's forward of
g - 1, a backward (B) after its own forward and the backward of g + 1, a W after its B.
Transfers cost `costs.comm` when they cross ranks (default 0: the published formulas
leave them out). Costs are DualPipe's notation (DeepSeek-AI 2024): F a forward, B a whole
backward, W its weight part -- a B that the schedule splits off a W costs B - W -- and F&B
an overlapped forward-backward pair (default F + B: nothing overlaps on one CPU core).

    idle(rank) = span - busy(rank);  bubble_fraction = mean idle / span

where the span runs from the first compute on any rank to the last end. With F=1, B=2,
W=1, p=4 and m=8, 1F1B idles (p-1)(F+B) = 9 of 33 slots per rank (27.3%), ZB-H1
(p-1)(F+B-2W) = 3 of 27 (11.1%): tests/test_pipeline_simulate.py. Activations: a
(micro-batch, chunk) is held from its forward until its backward has finished (its W where
split: the kept graph holds every saved tensor until then), counted in micro-batches of the
rank's layers (a chunk's count / v).

The planner takes its bubble and activation terms from here (plan/schedule_terms.py), the
`shardtrain schedule` command draws `grid` (shardtrain/cli.py), and the executor's measured
order is checked against `order` (tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from shardtrain.parallel.pipeline.schedules import (Action, Placement, Steps, compute_steps,
                                                    placement)

OVERLAPPED = ("dualpipev",)  # schedules whose two-compute steps are overlapped pairs


@dataclass(frozen=True)
class Costs:
    f: float = 1.0
    b: float = 2.0  # a whole backward: input and weight gradients
    w: float = 1.0  # the weight-gradient part of b
    fb: float | None = None  # an overlapped F&B pair; None: f + b
    comm: float = 0.0  # a transfer between ranks

    def of(self, a: Action, split: bool) -> float:
        return {"F": self.f, "W": self.w}.get(a.op, self.b - self.w if split else self.b)


@dataclass(frozen=True)
class Slot:
    start: float
    end: float
    actions: tuple[Action, ...]


@dataclass
class Simulation:
    pp: int
    v: int
    timelines: list[list[Slot]]  # [rank] -> its steps in order, timed
    span: float = 0.0
    idle: list[float] = field(default_factory=list)  # [rank]
    peak_activations: list[float] = field(default_factory=list)  # [rank], micro-batches

    @property
    def bubble_fraction(self) -> float:
        return sum(self.idle) / (len(self.idle) * self.span)

    def order(self, rank: int) -> list[Action]:
        """The rank's computes in the order it runs them."""
        return [a for slot in self.timelines[rank] for a in slot.actions]

    def to_dict(self) -> dict:
        return {"pp": self.pp, "virtual_stages": self.v, "span": self.span,
                "bubble_fraction": self.bubble_fraction, "idle": self.idle,
                "peak_activations": self.peak_activations,
                "timelines": [[{"start": s.start, "end": s.end,
                                "actions": [label(a, self.v) for a in s.actions]}
                               for s in rank] for rank in self.timelines]}


class Deadlock(ValueError):
    """Some rank waits for an input that no remaining step can produce."""


def simulate(schedule: str, pp: int, m: int, v: int = 1, costs: Costs = Costs()) -> Simulation:
    """The named schedule (schedules.SCHEDULES) replayed with `costs`."""
    return _cached(schedule, pp, m, v, costs)


@lru_cache(maxsize=512)  # the planner asks for the same few (schedule, p, m, v) often
def _cached(schedule: str, pp: int, m: int, v: int, costs: Costs) -> Simulation:
    return simulate_steps(compute_steps(schedule, pp, m, v), placement(schedule, pp, v),
                          costs, overlapped=schedule in OVERLAPPED)


def simulate_steps(steps: Steps, place: Placement, costs: Costs = Costs(), *,
                   overlapped: bool = False) -> Simulation:
    pp = place.pp
    split = [{(a.mb, a.chunk) for step in rank for a in step if a.op == "W"} for rank in steps]
    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # (op, mb, g) -> (end, rank)
    clock, pos = [0.0] * pp, [0] * pp
    timelines: list[list[Slot]] = [[] for _ in range(pp)]

    virtual = [[place.virtual(s, c) for c in range(place.v)] for s in range(pp)]

    def needs(s: int, a: Action) -> list[tuple[str, int, int]]:
        g = virtual[s][a.chunk]
        if a.op == "F":
            return [("F", a.mb, g - 1)] if g > 0 else []
        if a.op == "W":
            return [("B", a.mb, g)]
        return [("F", a.mb, g)] + ([("B", a.mb, g + 1)] if g < place.last else [])

    def plan(s: int, step: tuple[Action, ...]) -> tuple[list, list, list]:
        """(the step's inputs from other steps, its actions' keys, their costs)."""
        keys = [(a.op, a.mb, virtual[s][a.chunk]) for a in step]
        deps = [d for a in step for d in needs(s, a) if d not in keys]
        return deps, keys, [costs.of(a, (a.mb, a.chunk) in split[s]) for a in step]

    plans = [[plan(s, step) for step in rank] for s, rank in enumerate(steps)]
    while True:
        moved = False
        for s in range(pp):
            while pos[s] < len(steps[s]):
                deps, keys, step_costs = plans[s][pos[s]]
                if any(d not in done for d in deps):
                    break
                start = clock[s]
                for d in deps:
                    end, rank = done[d]
                    start = max(start, end + (costs.comm if rank != s else 0.0))
                t = start
                for key, cost in zip(keys, step_costs):  # in order
                    t += cost
                    done[key] = (t, s)
                if overlapped and len(keys) == 2 and costs.fb is not None:
                    t = start + costs.fb  # an overlapped pair ends together
                    for key in keys:
                        done[key] = (t, s)
                clock[s] = t
                timelines[s].append(Slot(start, t, steps[s][pos[s]]))
                pos[s] += 1
                moved = True
        if all(pos[s] == len(steps[s]) for s in range(pp)):
            break
        if not moved:
            raise Deadlock("deadlock: ranks wait on " + ", ".join(
                f"rank {s} at {steps[s][pos[s]]}" for s in range(pp) if pos[s] < len(steps[s])))
    sim = Simulation(pp, place.v, timelines)
    first = min(tl[0].start for tl in timelines if tl)
    sim.span = max(tl[-1].end for tl in timelines if tl) - first
    sim.idle = [sim.span - sum(x.end - x.start for x in tl) for tl in timelines]
    sim.peak_activations = [_peak(sim.order(s), split[s]) / place.v for s in range(pp)]
    return sim


def _peak(order: list[Action], split: set[tuple[int, int]]) -> int:
    live = peak = 0
    for a in order:
        live += (a.op == "F") - (a.op == "W" or (a.op == "B" and (a.mb, a.chunk) not in split))
        peak = max(peak, live)
    return peak


def label(a: Action, v: int) -> str:
    """F3, B3, W3; with several chunks per rank the chunk after a dot: F3.1."""
    return f"{a.op}{a.mb}" + (f".{a.chunk}" if v > 1 else "")


def grid(sim: Simulation) -> list[str]:
    """One line per rank, one column per time unit (the costs' unit; fractional costs round
    to whole columns): each cell the action running there, '.' where the rank idles."""
    first = min(tl[0].start for tl in sim.timelines if tl)
    cols = round(sim.span)
    cells = [["."] * cols for _ in sim.timelines]
    for s, tl in enumerate(sim.timelines):
        for slot in tl:
            lo, hi = round(slot.start - first), max(round(slot.end - first), 1)
            text = "&".join(label(a, sim.v) for a in slot.actions)
            for c in range(lo, min(hi, cols)):
                cells[s][c] = text
    width = max(len(c) for row in cells for c in row)
    return [f"rank {s}: " + " ".join(c.ljust(width) for c in row) for s, row in enumerate(cells)]
