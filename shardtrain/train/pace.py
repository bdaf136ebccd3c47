"""Stragglers: each rank's compute and wait seconds per step, brought to rank 0 on logged
steps, and the rule that names a rank persistently slower than its peers (docs/faults.md).

Seed 001: "If one GPU is slower than the others, the faster GPUs must wait": in synchronous
training the step takes as long as its slowest rank, and the others' share of that time is
spent blocked in the step's collectives. So the two figures of a rank's step are

- `compute_s`: the busy seconds of its forward and backward actions, from the step's
  timeline (parallel/pipeline/executor.py). Collectives issued inside the layers (tensor /
  sequence-parallel all-reduces, expert all-to-alls, ZeRO-3 gathers not prefetched) run
  within those actions and count here: a straggler's tensor-parallel partners wait inside
  their layers, look as slow as it, and are named with it.
- `wait_s`: the rest of the step's wall time, step_time_s - compute_s: the pipeline's
  transfers, the wait for the gradient all-reduce (or ZeRO's reduce-scatter and gathers),
  the loss and gradient-norm all-reduces, plus the clipping and optimizer arithmetic, small
  beside them. (The ledger's per-call `time_s` cannot give it: an asynchronous call's time
  runs from launch to completion, overlapped compute included.)

How they travel: on logged steps (every `train.log_every`, and the last) each rank's
(rank, compute_s, wait_s) goes to every rank in an all-gather over dp x cp, then tp, then
pp -- together the world of trainer ranks, all through the Communicator, ledger tag
`pace`. A parameter server's ranks run no step loop and are in none of those groups; its
async and ssp workers do not take steps together (`steps_together`), so there the gather
is skipped (it would make them wait for each other) and only rank 0's own figures are
recorded.

The rule: a rank is a straggler when, on each of the last `train.straggler_patience`
logged steps, its compute_s exceeded `train.straggler_factor` times the median compute_s
of its peers -- the other ranks of its pipeline stage, which do the same work (stages
differ: the last holds the output layer). A rank with no peers is never named.
`straggler_factor` 0 turns the rule off.
"""

from __future__ import annotations

import statistics
import sys
from collections import deque
from typing import Any

import torch
from tqdm import tqdm

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.pipeline.schedules import COMPUTE
from shardtrain.parallel.ps.update import steps_together

TAG = "pace"  # the gather's ledger tag: planner-vs-ledger byte checks leave it out


def busy_seconds(timeline: dict[str, Any]) -> float:
    """Seconds of a timeline's forward and backward actions."""
    return sum(a["end"] - a["start"] for a in timeline["actions"] if a["op"] in COMPUTE)


class StragglerRule:
    """Counts, per rank, the logged steps in a row on which its compute exceeded `factor`
    times the median of its peers' (ranks of the same `stage`)."""

    def __init__(self, factor: float, patience: int, stages: list[int]):
        self.factor, self.patience, self.stages = factor, patience, stages
        # the last `patience` ratios (compute / median of peers) of each rank's streak
        self.streaks: list[deque[float]] = [deque(maxlen=patience) for _ in stages]

    def update(self, compute: list[float]) -> dict[int, float]:
        """Feed one logged step's compute seconds (indexed by rank); returns the ranks that
        are stragglers now, each with its mean ratio over the window."""
        named = {}
        for rank, stage in enumerate(self.stages):
            peers = [c for r, c in enumerate(compute) if r != rank and self.stages[r] == stage]
            median = statistics.median(peers) if peers else 0.0
            ratio = compute[rank] / median if median > 0 else 0.0
            streak = self.streaks[rank]
            if self.factor and ratio > self.factor:
                streak.append(ratio)
            else:
                streak.clear()
            if len(streak) == self.patience:
                named[rank] = sum(streak) / len(streak)
        return named


class Pace:
    """The trainer's per-step figures (`measure`) and, on rank 0, the straggler warning."""

    def __init__(self, cfg: Config, mesh: ParallelMesh):
        t = cfg.train
        self.mesh, self.log_every, self.steps = mesh, t.log_every, t.steps
        self.factor, self.patience = t.straggler_factor, t.straggler_patience
        self.together = steps_together(cfg)
        stages = [mesh.shape.coords(r)["pp"] for r in range(mesh.world_size)]
        self.rule = StragglerRule(t.straggler_factor, t.straggler_patience, stages)
        self.named: set[int] = set()

    def measure(self, step: int, step_time: float, compute: float) -> dict[str, Any]:
        """This step's metrics fields from its seconds and its timeline's busy seconds
        (`busy_seconds`): compute_s and wait_s of this rank; on logged steps (a collective
        there, on every rank) every rank's, and the stragglers. Called at the flush
        (train/pending.py), for every step in order."""
        wait = max(0.0, step_time - compute)
        out: dict[str, Any] = {"compute_s": compute, "wait_s": wait}
        if not self.together or not (step % self.log_every == 0 or step == self.steps):
            return out
        rows = self.gather([float(self.mesh.rank), compute, wait]).tolist()  # [world, 3]
        out["rank_compute_s"] = [c for _, c, _ in rows]
        out["rank_wait_s"] = [w for _, _, w in rows]
        if self.factor:
            named = self.rule.update(out["rank_compute_s"])
            out["stragglers"] = sorted(named)
            new = [self.warning(r, named[r]) for r in sorted(set(named) - self.named)]
            self.named = set(named)
            if new:
                out["straggler_warnings"] = new
                if self.mesh.rank == 0:
                    for line in new:
                        tqdm.write(f"warning: {line}", file=sys.stderr)
        return out

    def warning(self, rank: int, ratio: float) -> str:
        return (f"rank {rank} is a straggler: compute {ratio:.1f}x the median of its peers "
                f"over the last {self.patience} logged steps (train.straggler_factor="
                f"{self.factor:g})")

    def gather(self, mine: list[float]) -> torch.Tensor:
        """[world, 3]: every trainer rank's `mine`, in rank order (mine[0] is the rank)."""
        rows = torch.tensor([mine], dtype=torch.float32, device=self.mesh.device)  # [1, 3]
        # dp x cp, then tp, pp and the replica groups span the trainer ranks; none spans them at
        # once, and making one would need every process, parameter servers included.
        for dim in ("dp_cp", "tp", "pp", "rep"):
            comm = self.mesh.comm(dim)
            out = rows.new_empty((comm.size * rows.shape[0], rows.shape[1]))  # [size * n, 3]
            comm.all_gather(out, rows, tag=TAG)
            rows = out
        rows = rows.cpu()
        return rows[rows[:, 0].argsort()]


def pace_table(records: list[dict[str, Any]]) -> list[str]:
    """The report's lines from metrics.jsonl records: each rank's mean compute and wait
    seconds over the logged steps that carry them (the first left out when there are
    others: it pays for warm-up), and the ranks named stragglers; [] without such steps."""
    logged = [r for r in records if "rank_compute_s" in r]
    if not logged:
        return []
    timed = logged[1:] or logged
    ranks = len(timed[0]["rank_compute_s"])
    lines = [f"per-rank compute and wait (mean of {len(timed)} logged steps):",
             f"{'rank':>5} {'compute s':>10} {'wait s':>10}"]
    for rank in range(ranks):
        compute = sum(r["rank_compute_s"][rank] for r in timed) / len(timed)
        wait = sum(r["rank_wait_s"][rank] for r in timed) / len(timed)
        lines.append(f"{rank:>5} {compute:>10.4f} {wait:>10.4f}")
    if any("stragglers" in r for r in logged):  # absent: the rule was off
        named = sorted({rank for r in logged for rank in r.get("stragglers", [])})
        lines.append("stragglers: " + (", ".join(f"rank {r}" for r in named) or "none named"))
    lines += [f"  step {r['step']}: {w}" for r in logged for w in r.get("straggler_warnings", [])]
    return lines
