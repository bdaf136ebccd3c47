"""The trainer's side of the replica groups (parallel/replica/): which CrossReplica the
run uses, the step's quorum handed to the sampler, the commit that decides whether a step
is applied, the state a rejoining group receives, and the record's fields."""

from __future__ import annotations

import sys
from typing import Any

import torch

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.replica.build import make_cross_replica
from shardtrain.parallel.replica.sync import ReplicaSync
from shardtrain.parallel.replica.transfer import PiecesReader, pieces_state


class TrainReplicas:
    """parallel.replicas = 1: nothing (no group to cross; every call is free). Otherwise the
    run's CrossReplica and its sync mode, set on the strategy (parallel/strategy.py)."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, parallel: Any, sampler: Any):
        self.parallel, self.sampler = parallel, sampler
        self.cross = make_cross_replica(cfg, mesh) if cfg.parallel.replicas > 1 else None
        self.rejoins = cfg.fault.mode == "replicas"  # a restarted group takes a peer's state
        self.sync: ReplicaSync | None = None
        self._before: dict[str, Any] = {}  # the sampler's state at the step's start
        if self.cross is not None:
            self.sync = ReplicaSync(cfg, self.cross, parallel.update.replica_view())
            parallel.replica = self.sync

    def begin(self, trainer: Any) -> None:
        """At the step's start: its quorum (torchft may first load a live peer's state
        through `attach`, the step included), and this group's share of its batch."""
        if self.sync is None:
            return
        self.cross.begin_step(trainer.step)
        self.sync.step = trainer.step + 1  # the step being taken
        self.sampler.share(self.cross.position, self.cross.live)
        self._before = self.sampler.state_dict()

    def commit(self) -> bool:
        """Whether the step may be applied. Not: the sampler goes back to the step's start,
        so its samples are the next step's (none skipped)."""
        if self.cross is None or self.cross.commit():
            return True
        self.sampler.load_state_dict(self._before)
        return False

    def record(self, applied: bool) -> dict[str, Any]:
        """The step's record fields: the quorum and what happened (CrossReplica.events)."""
        if self.cross is None:
            return {}
        return {"replicas_live": self.cross.live, "committed": applied, **self.cross.events()}

    def metric_sum(self, totals: torch.Tensor) -> None:
        """Sum `totals` over the live groups (an evaluation's [loss sum, weight])."""
        if self.cross is not None:
            self.cross.all_reduce([totals], "sum", tag="rep:metric")

    def attach(self, trainer: Any) -> None:
        """What a rejoining group receives from a live peer: this rank's pieces (parameters,
        optimizer state, DiLoCo's outer state), the step and the sampler's state."""
        if self.cross is None:
            return

        def state() -> dict[str, Any]:
            return {"step": trainer.step, "sampler": self.sampler.state_dict(),
                    "pieces": pieces_state(self.parallel)}

        def load(state: dict[str, Any]) -> None:
            self.parallel.load_state(PiecesReader(state["pieces"]))
            self.sampler.load_state_dict(state["sampler"])
            trainer.step = int(state["step"])

        self.cross.attach(state, load)

    def kept_records(self, resumed: bool, step: int) -> dict[str, Any]:
        """MetricsWriter's resume and from_step: a checkpoint's step, or for a replica group
        its launcher restarted (fault.mode=replicas: it rejoins from a peer, past every step
        its previous attempt recorded) all of that attempt's records."""
        from shardtrain.train.guard import restart_count

        if self.rejoins and restart_count() and not resumed:
            return {"resume": True, "from_step": sys.maxsize}
        return {"resume": resumed, "from_step": step}

    def close(self) -> None:
        if self.cross is not None:
            self.cross.close()
