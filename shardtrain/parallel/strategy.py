"""The one interface between the trainer and a layout.

A layout is two halves, composed rather than subclassed:
- the model half, the same for every layout: this rank's part of the model (its pipeline
  stage, its tensor-parallel shards: `StageShards`) and the pipeline executor that runs a
  step's micro-batches through it (one stage and plain gradient accumulation without
  pipeline parallelism);
- the update half (`Update`): what happens to the gradients after backward and how the
  optimizer steps. Plain data parallelism (data/ddp.py `ReplicatedUpdate`), top-k update
  compression (data/topk.py `SparseUpdates`) and ZeRO-1/2/3 (zero/model.py `ZeroModel`)
  each implement it.

`Strategy` joins them and is all the trainer sees: it never asks which layout it runs. It
also owns the step's precision bookkeeping (precision.py): the loss scale each micro-batch's
loss is multiplied by, the unscaling before clipping, and the skip of a step whose loss or
gradients are not finite -- the same for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardtrain.ckpt.files import Piece, Reader
from shardtrain.parallel.pieces import local_tensor, stash_key, tensor_piece
from shardtrain.parallel.precision import LossScaler, PrecisionPolicy

if TYPE_CHECKING:
    from shardtrain.parallel.offload_activations import ActivationOffload
    from shardtrain.parallel.pipeline.runtime import Batch, Pipeline
    from shardtrain.parallel.pipeline.state import StageShards
    from shardtrain.parallel.replica.sync import ReplicaSync


class Update(Protocol):
    """The gradient synchronisation and optimizer step of a layout."""

    def no_sync(self) -> AbstractContextManager:
        """An accumulation micro-step: what it need not communicate, it does not."""

    def zero_grad(self) -> None: ...

    def finish(self) -> None:
        """After the step's last backward: the gradients are those of the full batch."""

    def clip_grad_norm(self, max_norm: float, unscale: float = 1.0) -> torch.Tensor:
        """Multiply the gradients by `unscale` (fp16: 1 / loss scale), then return the whole
        model's gradient L2 norm, the same on every rank holding gradients (dp, tp, pp: a
        non-finite gradient anywhere makes it non-finite everywhere); gradients scaled to
        at most `max_norm`."""

    def step(self, lr: float) -> None: ...

    def memory(self) -> dict[str, int]:
        """Model-state bytes this rank holds: params, grads, optimizer, master."""

    def local_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This rank's parameters where they are not the module's own (ZeRO's master
        shards), else None."""

    def state_pieces(self) -> list[Piece]:
        """This rank's model and optimizer tensors as checkpoint pieces (parallel/pieces.py:
        layout-independent names and coordinates), read when written."""

    def optim_steps(self) -> int:
        """The optimizer steps taken (bias correction), kept with the pieces."""

    def load_state(self, reader: Reader, steps: int) -> None:
        """This rank's model and optimizer state from a checkpoint of any layout."""

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        """{checkpoint file name: state}: state that is this rank's own, not pieces of the
        single-process model's (top-k's residual, the parameter servers'); a collective on
        every rank. Only the layout that wrote them reads them back."""

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None: ...


@dataclass
class Strategy:
    shards: StageShards
    pipeline: Pipeline
    update: Update
    policy: PrecisionPolicy
    scaler: LossScaler
    loss_scale: float = field(default=1.0, init=False)  # the scale of the last step's backward
    # False where the replicas do not take each step together (a parameter server's async
    # and ssp workers): the loss is then this rank's own, as a per-step all-reduce would
    # make them wait for each other.
    average_loss: bool = True
    activation_offload: ActivationOffload | None = None  # train.activation_offload = cpu
    # The last step's mean loss (replica-averaged): a non-finite one skips the step too.
    last_loss: torch.Tensor | None = field(default=None, init=False)
    # parallel.replicas: what crosses the replica groups (parallel/replica/sync.py); set
    # by the trainer (train/replicas.py), None for a single group.
    replica: ReplicaSync | None = field(default=None, init=False)

    @property
    def module(self) -> nn.Module:
        """The parameters this rank holds: the model, or its pipeline stage."""
        return self.shards.model

    @property
    def timeline(self) -> dict[str, Any] | None:
        """The last training step's timeline (parallel/pipeline/executor.py), its action
        times read (on CUDA: events the step's agreed decision has passed)."""
        self.pipeline.executor.settle()
        return self.pipeline.timeline

    def zero_grad(self) -> None:
        self.update.zero_grad()

    def forward_backward(self, micro_batches: list[Batch], loss_tokens: int | None = None
                         ) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step, gradients
        accumulated and synchronised. `loss_tokens`: the global batch's counted targets
        (pipeline/runtime.py; None: all of them). Returns the step's mean loss over them,
        the same on every rank (`average_loss`; else this rank's)."""
        loss = self.pipeline.train(micro_batches, no_sync=self.update.no_sync,
                                   loss_scale=self.scaler.scale, loss_tokens=loss_tokens,
                                   groups=self.replica.live if self.replica else 1)
        self.update.finish()
        if self.replica:  # every_step: the groups' gradients averaged, before clipping
            self.replica.gradients()
        if not self.average_loss:
            return loss  # this rank's own: its verdict would not be its peers' (no skip on it)
        self.last_loss = self.pipeline.average_over_replicas(loss)
        if self.replica:
            self.replica.metric(self.last_loss)
        return self.last_loss

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """The mean loss of one batch, forward only, the same on every stage, and its
        weight: the share of this rank's targets that count (pipeline/runtime.py)."""
        return self.pipeline.evaluate(batch)

    @contextmanager
    def evaluating(self):
        self.module.eval()
        try:
            yield
        finally:
            self.module.train()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Unscale, take the norm, clip; decide whether this step is skipped (`skipped`) and
        move the loss scale (precision.py). Returns the norm of the unscaled gradients."""
        self.loss_scale = self.scaler.scale  # the scale this step's backward used
        norm = self.update.clip_grad_norm(max_norm, unscale=1.0 / self.scaler.scale)
        self.scaler.update(norm, self.last_loss)
        self.last_loss = None
        return norm

    @property
    def skipped(self) -> bool:
        """The last step's loss or gradients were not finite: its update was not applied."""
        return self.scaler.skipped

    @property
    def bad(self) -> bool:
        """The last step was skipped for a reason loss scaling does not explain (precision.py)."""
        return self.scaler.bad

    def step(self, lr: float) -> None:
        """The optimizer step, unless the gradients overflowed: then no weight and no
        optimizer state changes (every rank agrees: the norm is the same everywhere)."""
        if not self.scaler.skipped:
            self.update.step(lr)
        if self.replica:  # local_sgd / diloco: every group, skipped or not, in lockstep
            self.replica.after_step()

    def memory(self) -> dict[str, int]:
        return self.update.memory()

    def activation_ledger(self) -> dict[str, int]:
        """Activation offload's bytes moved down and up and the peaks held on the host and
        in the device window (offload_activations.py); {} without it."""
        offload = self.activation_offload
        return offload.ledger() if offload is not None else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process model's state dict (a collective over tp, pp and, for ZeRO,
        dp), whatever the layout."""
        return self.shards.full_state_dict(self.update.local_state_dict())

    def state_pieces(self) -> tuple[list[Piece], dict[str, Any]]:
        """(this rank's checkpoint pieces, the small state kept beside them: the optimizer's
        step count and the loss scaler's, the same on every rank)."""
        extra = {"optim_steps": self.update.optim_steps()}
        if self.scaler.dynamic:
            extra["scaler"] = self.scaler.state_dict()
        own = self.update.state_pieces() + self._stash_pieces()
        if not self.replica:
            return own, extra
        # local_sgd / diloco in one checkpoint of every group: each group's own weights and
        # inner optimizer state (they differ between syncs, and the moments always), and
        # DiLoCo's outer state, the same in every group, once (parallel/replica/sync.py)
        return self.replica.own_pieces(own) + self.replica.pieces(), extra

    def _stash_pieces(self) -> list[Piece]:
        """PipeDream-2BW's second weight version (pipeline/pipedream.py), or none."""
        versions = self.pipeline.versions
        if versions is None:
            return []
        stashed = versions.stashed(self.shards.named, set(self.shards.tied_to))
        return [tensor_piece(self.shards, stash_key(n), n, t) for n, t in stashed.items()]

    def load_state(self, reader: Reader) -> None:
        """A checkpoint of any layout. One written in another precision has no scaler
        state: an fp16 run resumed from it starts at the initial scale. Under local_sgd /
        diloco each group reads its own state where the checkpoint has it (sync.py)."""
        if self.replica:
            with self.replica.own_state(reader):
                return self._load_state(reader)
        self._load_state(reader)

    def _load_state(self, reader: Reader) -> None:
        self.update.load_state(reader, int(reader.extra.get("optim_steps", 0)))
        if self.pipeline.versions is not None:  # W(t-1) where the checkpoint has it
            stashed = self.pipeline.versions.stashed(self.shards.named, set(self.shards.tied_to))
            with torch.no_grad():
                for n, t in stashed.items():
                    if reader.has(stash_key(n)):
                        t.copy_(local_tensor(self.shards, reader, stash_key(n), n, t))
        if self.scaler.dynamic and "scaler" in reader.extra:
            self.scaler.load_state_dict(reader.extra["scaler"])
        if self.replica:
            self.replica.load(reader)

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        return self.update.optimizer_files(is_main)

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        self.update.load_optimizer_files(load)


def rank_file(coords: dict[str, int]) -> str:
    """The checkpoint file of one rank's own optimizer state (ZeRO shards, top-k's per-rank
    state), named by its mesh coordinates (the cp coordinate where it is not 0: ZeRO
    shards over dp x cp under context parallelism)."""
    cp = f"_cp{coords['cp']}" if coords.get("cp") else ""
    return f"optimizer_pp{coords['pp']}_dp{coords['dp']}{cp}_tp{coords['tp']}.pt"


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter state tensors."""
    return nbytes(*(t for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor)))
