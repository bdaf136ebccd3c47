"""parallelize(model, mesh, cfg): apply a layout to the plain model, in one documented order.

Order: tensor/sequence parallel -> context parallel -> expert parallel -> activation
checkpointing -> pipeline split -> ZeRO / data parallel. This release implements
activation checkpointing and data parallelism; config validation rejects the others.
"""

from __future__ import annotations

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.model.transformer import Transformer
from shardtrain.parallel.activation import checkpoint_blocks
from shardtrain.parallel.data import DataParallel


def parallelize(model: Transformer, mesh: ParallelMesh, cfg: Config) -> DataParallel:
    """Modify `model` in place for the layout; return the gradient reducer the trainer drives."""
    if cfg.train.activation_checkpointing == "full":
        checkpoint_blocks(model.layers)
    return DataParallel(model, mesh.comm("dp"), bucket_mb=cfg.comm.bucket_mb)
