"""parallelize(model, mesh, cfg): apply a layout to the plain model, in one documented order.

Order: tensor/sequence parallel -> context parallel -> expert parallel -> activation
checkpointing -> pipeline split -> ZeRO / data parallel. This release implements tensor and
sequence parallelism, activation checkpointing and data parallelism (over the dp group);
config validation rejects the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.model.transformer import Transformer
from shardtrain.parallel.activation import checkpoint_blocks
from shardtrain.parallel.data import DataParallel
from shardtrain.parallel.sharding import TensorShards
from shardtrain.parallel.tensor import apply_tensor_parallel
from shardtrain.parallel.vocab import cross_entropy


@dataclass
class Parallelized:
    """What the trainer drives: the gradient reducer, the loss of the model's output, and the
    sharded state (full state dicts in and out, gradient sums over tp, the grad norm)."""

    reducer: DataParallel
    shards: TensorShards
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, targets) -> mean

    def sync_grads(self) -> None:
        """After the last backward of a step: every gradient is that of the full batch."""
        self.reducer.finish()
        self.shards.sum_partial_grads()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.shards.clip_grad_norm(max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.shards.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.shards.load_full_state_dict(state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.shards.full_optimizer_state_dict(optimizer)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self.shards.load_full_optimizer_state_dict(optimizer, state)


def parallelize(model: Transformer, mesh: ParallelMesh, cfg: Config, *,
                device: torch.device) -> Parallelized:
    """Apply the layout to `model`, built on the meta device (`build_model(seed=None)`), in
    place: swap in tensor-parallel modules, materialise this rank's shards on `device` and
    initialise them from `cfg.train.seed` (the slices of the single-process weights), then
    checkpoint activations and hook data parallelism over the dp group."""
    tp = mesh.comm("tp")
    placements, loss = {}, cross_entropy
    if tp.size > 1:
        placements, loss = apply_tensor_parallel(model, tp, sp=cfg.parallel.sp)
    model.to_empty(device=device)
    shards = TensorShards(model, tp, placements)
    shards.init_weights(cfg.train.seed)
    if cfg.train.activation_checkpointing == "full":
        checkpoint_blocks(model.layers)
    c = cfg.comm
    reducer = DataParallel(model, mesh.comm("dp"), bucket_mb=c.bucket_mb, compress=c.compress,
                           topk_ratio=c.topk_ratio, quant_block=c.quant_block,
                           error_feedback=c.error_feedback)
    return Parallelized(reducer=reducer, shards=shards, loss=loss)
