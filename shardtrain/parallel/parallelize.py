"""parallelize(model, mesh, cfg): apply a layout to the plain model, in one documented order.

Order: tensor/sequence parallel -> context parallel -> expert parallel -> activation
checkpointing -> pipeline split -> ZeRO / data parallel. This release implements tensor and
sequence parallelism, activation checkpointing, pipeline parallelism (pipeline/), data
parallelism and ZeRO-1/2/3 (over the dp group, zero.py); config validation rejects the
others. Every layout runs its micro-batches through the pipeline executor: without
pipeline parallelism that is one stage holding the whole model, and the schedule is plain
gradient accumulation.

`Parallelized` is what the trainer drives, whatever the layout: the replicated layout
(DP: a torch optimizer over full parameters), its top-k variant (`SparseUpdateParallelized`:
each dp rank's optimizer on its local gradient, sparse updates exchanged) and ZeRO
(`ZeroParallelized`: a shard optimizer over flat units) answer the same calls, so the
trainer has no per-stage branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.model.transformer import Transformer
from shardtrain.parallel.activation import checkpoint_blocks
from shardtrain.parallel.data.topk import SparseUpdates
from shardtrain.parallel.data.ddp import DataParallel
from shardtrain.parallel.pipeline.runtime import Batch, Pipeline
from shardtrain.parallel.pipeline.stage import split_stages
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.tensor.sharding import TensorShards
from shardtrain.parallel.tensor.layers import apply_tensor_parallel
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.parallel.zero.model import ZeroModel, ZeroReducer
from shardtrain.parallel.zero.zeropp import build_unit_comm

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


@dataclass
class Parallelized:
    """What the trainer drives: the gradient reducer, the loss of the model's output, and the
    sharded state (full state dicts in and out, gradient sums over tp, the grad norm)."""

    reducer: DataParallel | ZeroReducer | SparseUpdates
    shards: TensorShards
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, targets) -> mean
    pipeline: Pipeline
    optimizer: torch.optim.Optimizer | None = None  # the replicated layout's

    @property
    def module(self) -> torch.nn.Module:
        """The parameters this rank holds: the model, or its pipeline stage."""
        return self.shards.model

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step through the
        pipeline schedule, gradients accumulated and synchronised (`sync_grads`). Returns
        the step's mean loss, the same on every rank."""
        loss = self.pipeline.train(micro_batches, no_sync=self.reducer.no_sync)
        self.sync_grads()
        return self.pipeline.average_over_replicas(loss)

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only (evaluation), the same on every stage."""
        return self.pipeline.evaluate(inputs, targets)

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

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def memory(self) -> dict[str, int]:
        """Model-state bytes held by this rank, from the tensors. Parameters are the fp32
        master weights (bf16 runs compute under autocast): no separate master copy."""
        params = sum(p.numel() * p.element_size() for p in self.shards.model.parameters())
        opt = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                  for t in state.values() if isinstance(t, torch.Tensor))
        return {"params_bytes": params, "grads_bytes": self.reducer.grad_bytes,
                "optimizer_bytes": opt, "master_bytes": 0}

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        """{checkpoint file name: state} this rank writes: the full optimizer state
        (gathered over tp, a collective), written by the main rank."""
        state = self.shards.full_optimizer_state_dict(self.optimizer)
        return {"optimizer.pt": state} if is_main else {}

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        self.shards.load_full_optimizer_state_dict(self.optimizer, load("optimizer.pt"))


@dataclass
class ZeroParallelized(Parallelized):
    """ZeRO (zero.py): gradients, clipping, the step and the optimizer state on shards.
    Checkpoints hold the full model weights (written by the main rank) and one optimizer
    file per rank: its master and optimizer-state shards."""

    zero: ZeroModel | None = None

    def sync_grads(self) -> None:
        self.zero.sync_grads()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.zero.clip_grad_norm(max_norm)

    def optimizer_step(self, lr: float) -> None:
        self.zero.step(lr)

    def memory(self) -> dict[str, int]:
        return self.zero.memory()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.shards.full_state_dict(self.zero.local_state_dict())

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.zero.load_local_state_dict(self.shards.local_state_dict(state))

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        return {self._file(): self.zero.optimizer.state_dict()}

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        self.zero.optimizer.load_state_dict(load(self._file()))

    def _file(self) -> str:
        return (f"optimizer_pp{self.shards.pp.rank}_dp{self.zero.comm.rank}"
                f"_tp{self.shards.comm.rank}.pt")


@dataclass
class SparseUpdateParallelized(Parallelized):
    """comm.compress=topk (compressed_update.py): gradients stay local, each dp rank clips
    its own and steps its own optimizer, and the updates travel top-k sparsified. Optimizer
    state and residual differ per dp rank: checkpoints hold one optimizer file per rank,
    and only the same layout and compression resume from them (train/checkpoint.py)."""

    def optimizer_step(self, lr: float) -> None:
        self.reducer.step(lr)

    def memory(self) -> dict[str, int]:
        mem = super().memory()
        return {**mem, "optimizer_bytes": mem["optimizer_bytes"] + self.reducer.residual_bytes}

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        return {self._file(): {"optimizer": self.optimizer.state_dict(),
                               "updates": self.reducer.state_dict()}}

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        state = load(self._file())
        self.optimizer.load_state_dict(state["optimizer"])
        self.reducer.load_state_dict(state["updates"])

    def _file(self) -> str:
        return (f"optimizer_pp{self.shards.pp.rank}_dp{self.reducer.comm.rank}"
                f"_tp{self.shards.comm.rank}.pt")


def parallelize(model: Transformer, mesh: ParallelMesh, cfg: Config, *,
                device: torch.device, make_optimizer: MakeOptimizer) -> Parallelized:
    """Apply the layout to `model`, built on the meta device (`build_model(seed=None)`), in
    place: swap in tensor-parallel modules, materialise this rank's shards on `device` and
    initialise them from `cfg.train.seed` (the slices of the single-process weights), then
    checkpoint activations and hook data parallelism or ZeRO over the dp group.
    `make_optimizer` builds the torch optimizer of the replicated layout; ZeRO builds its
    shard optimizer from `cfg.optim` (the same update, weight decay on matrices only)."""
    tp, pp = mesh.comm("tp"), mesh.comm("pp")
    placements, loss = {}, cross_entropy
    if tp.size > 1:
        placements, loss = apply_tensor_parallel(model, tp, sp=cfg.parallel.sp)
    if cfg.train.activation_checkpointing == "full":
        checkpoint_blocks(model.layers)
    # Pipeline split: this rank's stage (the model itself when pp = 1), the only part
    # materialised; the full model's names order the layout-independent state dicts.
    module, chunks = split_stages(model, cfg, stage=pp.rank)
    reference_keys = list(model.state_dict())
    name_of = {p: n for n, p in model.named_parameters()}
    reference_groups = [[name_of[p] for p in group["params"]]
                        for group in make_optimizer(model).param_groups]
    module.to_empty(device=device)
    module.tie_weights()  # to_empty gives the tied modules a tensor each
    shards = StageShards(module, tp, placements, pp=pp, reference_keys=reference_keys,
                         reference_groups=reference_groups, tied=cfg.model.tie_embeddings)
    shards.init_weights(cfg.train.seed)
    pipeline = Pipeline(chunks, mesh, cfg, loss=loss, device=device)
    if cfg.parallel.zero:
        unit_comm = build_unit_comm(mesh, cfg.parallel, block=cfg.comm.quant_block)  # ZeRO++
        zero = ZeroModel(module, mesh.comm("dp"), shards, cfg, unit_comm=unit_comm)
        return ZeroParallelized(reducer=zero.reducer, shards=shards, loss=loss,
                                pipeline=pipeline, zero=zero)
    c = cfg.comm
    if c.compress == "topk":
        optimizer = make_optimizer(module)
        updates = SparseUpdates(mesh.comm("dp"), optimizer, ratio=c.topk_ratio,
                                error_feedback=c.error_feedback,
                                warmup_steps=c.topk_warmup_steps)
        return SparseUpdateParallelized(reducer=updates, shards=shards, loss=loss,
                                        pipeline=pipeline, optimizer=optimizer)
    reducer = DataParallel(module, mesh.comm("dp"), bucket_mb=c.bucket_mb, compress=c.compress,
                           quant_block=c.quant_block)
    return Parallelized(reducer=reducer, shards=shards, loss=loss, pipeline=pipeline,
                        optimizer=make_optimizer(module))
