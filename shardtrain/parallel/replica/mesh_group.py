"""CrossReplica over the mesh's `rep` process group (fault.mode = restart): the replica
groups are a fixed set inside one torch.distributed world, so every step's quorum is all R
of them, nothing is ever transferred, and every commit succeeds. A failure is handled the
classic way (torchrun restarts the job, which resumes from its newest checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from shardtrain.mesh import ParallelMesh


class MeshReplicas:
    """The replica dimension of a ParallelMesh built with rep = parallel.replicas."""

    shared_checkpoint = True  # every group's ranks write one checkpoint (sync.py's prefix)

    def __init__(self, mesh: ParallelMesh):
        self.comm = mesh.comm("rep")  # this rank's peers: one per group, same coordinates
        self.replica, self.replicas = self.comm.rank, self.comm.size

    @property
    def live(self) -> int:
        return self.replicas

    @property
    def position(self) -> int:
        return self.replica

    def begin_step(self, step: int) -> None:
        pass  # the quorum is fixed: every group, every step

    def all_reduce(self, tensors: list[torch.Tensor], op: Literal["sum", "avg"], *,
                   tag: str) -> None:
        for t in tensors:  # the ledger records each call under `tag` (comm/ledger.py)
            self.comm.all_reduce(t, op, tag=tag)

    def commit(self) -> bool:
        return True  # no member can drop out of a step and leave the others stepping

    def attach(self, state_dict: Callable[[], dict[str, Any]],
               load_state_dict: Callable[[dict[str, Any]], None]) -> None:
        pass  # no group ever rejoins from a peer: a restart resumes from disk

    def events(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
