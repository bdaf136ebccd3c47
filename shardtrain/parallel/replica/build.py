"""The CrossReplica a run uses, from fault.mode (parallel/replica/__init__.py)."""

from __future__ import annotations

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.replica import CrossReplica


def make_cross_replica(cfg: Config, mesh: ParallelMesh) -> CrossReplica:
    """restart: the mesh's `rep` groups (one world, R = 1 included: a group of one rank
    whose collectives are no-ops); replicas: torchft's managed group, imported only here
    (torchft is needed by that mode alone)."""
    if cfg.fault.mode == "replicas":
        from shardtrain.parallel.replica.torchft_group import TorchftReplicas

        return TorchftReplicas(cfg, mesh)
    from shardtrain.parallel.replica.mesh_group import MeshReplicas

    return MeshReplicas(mesh)
