"""`shardtrain report`'s simulated side: the run's schedule replayed by the simulator
(parallel/pipeline/simulate.py) at the costs the run measured, beside what it measured.

Costs, in units of the mean forward: B the whole backward (the mean B, plus the mean W
where the backward was split), W the mean W. The order check compares each rank's computes
(F, B, W, by micro-batch and chunk) with the simulator's for its stage: slots, not seconds.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from shardtrain.parallel.pipeline.simulate import Costs, simulate

Timeline = dict[str, Any]


def simulated_lines(timelines: list[Timeline]) -> list[str]:
    t0 = timelines[0]
    took = {op: [a["end"] - a["start"] for t in timelines for a in t["actions"] if a["op"] == op]
            for op in "FBW"}
    f = mean(took["F"]) or 1e-9
    w = mean(took["W"]) / f if took["W"] else 0.0
    costs = Costs(f=1.0, b=mean(took["B"]) / f + w, w=w)
    sim = simulate(t0["schedule"], t0["pp"], t0["microbatches"], t0["virtual_stages"], costs)
    differ = [t["rank"] for t in timelines
              if [(a["op"], a["mb"], a["chunk"]) for a in t["actions"] if a["op"] in "FBW"]
              != [(a.op, a.mb, a.chunk) for a in sim.order(t["stage"])]]
    order = f"differs on ranks {differ}" if differ else "the simulator's on every rank"
    return [f"simulated at the measured costs (F=1, B={costs.b:.2f}, W={costs.w:.2f}): bubble "
            f"{sim.bubble_fraction:.1%}; the order of computes: {order}"]
