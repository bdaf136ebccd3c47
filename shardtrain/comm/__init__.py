"""Every byte goes through here: a Communicator per process group, the algorithms it runs,
the ledger that records each call, and gradient compression. The cost model `auto` prices
with lives in shardtrain.cost (torch-free, shared with the planner).

The mesh (shardtrain.mesh) owns the topology and the process groups and knows nothing of
this package; `CommFactory` turns each of its groups into a Communicator, and
`build_mesh` builds a mesh with one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardtrain.comm.communicator import Communicator
from shardtrain.comm.dispatch import Handle
from shardtrain.comm.ledger import CommLedger, CommRecord
from shardtrain.comm.p2p import CommError, CommTimeout
from shardtrain.cost.link import Link
from shardtrain.mesh import Group, MeshShape, ParallelMesh

__all__ = ["CommError", "CommFactory", "CommLedger", "CommRecord", "CommTimeout", "Communicator",
           "Handle", "build_mesh"]


@dataclass
class CommFactory:
    """Builds a mesh group's Communicator with the run's comm settings (comm.algorithm,
    comm.timeout_s); every communicator it builds records in its one ledger."""

    algorithm: str = "native"
    timeout_s: float = 300.0
    check_sizes: str = "first"
    ledger: CommLedger = field(default_factory=CommLedger)
    kind: type[Communicator] = Communicator  # the dry run's subclass (train/start/dryrun.py)

    def __call__(self, group: Group) -> Communicator:
        return self.kind(group.handle, name=group.name, ranks=group.ranks,
                            ledger=self.ledger, node_size=group.node_size,
                            algorithm=self.algorithm, timeout_s=self.timeout_s,
                            link=group.link, device=group.device, meta=group.meta,
                            check_sizes=self.check_sizes)


def build_mesh(shape: MeshShape, *, rank: int = 0, node_size: int = 0, algorithm: str = "native",
               timeout_s: float = 300.0, device: torch.device | None = None,
               link: Link | None = None, group_timeout_s: float | None = None) -> ParallelMesh:
    """The mesh of `shape` for this rank, each dim's group with its Communicator.
    `group_timeout_s`: the process groups' own timeout where it differs from the
    communicators' (NCCL: a backstop behind the hang watchdog, comm/watchdog.py)."""
    return ParallelMesh(shape, rank=rank, node_size=node_size,
                        timeout_s=timeout_s if group_timeout_s is None else group_timeout_s,
                        device=device, link=link,
                        communicator=CommFactory(algorithm=algorithm, timeout_s=timeout_s))
