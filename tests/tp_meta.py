"""Rank 0's tensor-parallel parameters as the runtime builds them on the meta device over
the fake process group (train/start/dryrun.py): what the planner's exact per-rank list
(plan/rank_states.py `rank0_tensors`) is compared with."""

from __future__ import annotations

import torch.distributed as dist

from shardtrain.comm import CommFactory
from shardtrain.config import ModelConfig
from shardtrain.cost.hardware import runtime_link
from shardtrain.mesh import MeshShape, ParallelMesh
from shardtrain.model.transformer import build_model
from shardtrain.parallel.tensor.layers import apply_tensor_parallel
from shardtrain.train.start import dryrun


def tp_rank0_tensors(cfg: ModelConfig, tp: int = 2) -> list[tuple[str, int]]:
    """(name, elements) of rank 0's parameters after `apply_tensor_parallel` at `tp`."""
    dryrun.fake_world(tp)
    try:
        mesh = ParallelMesh(MeshShape(tp=tp), rank=0, communicator=CommFactory(
            kind=dryrun.ZeroFilledCommunicator), link=runtime_link("cpu", gpu_name="",
                                                                    across_nodes=False))
        model = build_model(cfg, seed=None)
        apply_tensor_parallel(model, mesh.comm("tp"), sp=False)
        return [(n, p.numel()) for n, p in model.named_parameters()]
    finally:
        dist.destroy_process_group()
