"""Replica groups (docs/faults.md): parallel.replicas = R groups hold the same model, each
sharded inside as its layout says (ZeRO over dp / R, tp, pp, cp, ep: HSDP), and what
parallel.sync names crosses them - the gradients every step, or the weights every H.

`CrossReplica` is the one interface the training step uses for the replica dimension. Two
implementations: over the mesh's `rep` process group (fault.mode = restart: a fixed set of
groups in one torch.distributed world; mesh_group.py), and over torchft's managed process
group (fault.mode = replicas: each group its own world, a lighthouse deciding each step's
quorum, a failed group dropping out and rejoining from a live peer; torchft_group.py).

Per optimizer step the trainer calls, in order:
    begin_step(step)        the step's quorum (torchft: may first load a peer's state
                            through the attached callbacks; the mesh: nothing)
    all_reduce(...)         as often as the sync mode needs (gradients, weights, metrics)
    commit()                whether the step may be applied (torchft's commit protocol:
                            False when a peer failed inside the step; the mesh: True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch


class CrossReplica(Protocol):
    replica: int  # this group's index, 0..replicas-1 (its launch slot)
    replicas: int  # the configured number of groups, R
    # True where every group's ranks write one checkpoint (the mesh's groups), False where
    # each group writes its own run directory (torchft's)
    shared_checkpoint: bool

    @property
    def live(self) -> int:
        """Groups taking part in the current step (R unless one failed)."""

    @property
    def position(self) -> int:
        """This group's index among the current step's live groups, 0..live-1 (what the
        data sampler shares the step's samples by)."""

    def begin_step(self, step: int) -> None: ...

    def all_reduce(self, tensors: list[torch.Tensor], op: Literal["sum", "avg"], *,
                   tag: str) -> None:
        """In place over the live groups' same-coordinate ranks; every byte recorded in the
        mesh's ledger under `tag` (rep:grad, rep:weights, rep:metric)."""

    def commit(self) -> bool: ...

    def attach(self, state_dict: Callable[[], dict[str, Any]],
               load_state_dict: Callable[[dict[str, Any]], None]) -> None:
        """What a rejoining group receives from a live peer with its coordinates: this
        rank's parameters and optimizer state, the step, the sampler's and the sync mode's
        state (the mesh's groups never transfer: a no-op there)."""

    def events(self) -> dict[str, Any]:
        """The step's record fields: quorum size, participating groups, and what happened
        (lost, rejoined, transfer bytes and seconds); {} where nothing can happen."""

    def close(self) -> None: ...
