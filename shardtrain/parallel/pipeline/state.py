"""What spans the pipeline stages: full state dicts, the tied-embedding gradient, the norm.

`StageShards` is `TensorShards` (one stage's tensor-parallel slices) plus the pipeline
group: the full model state dict (the end-of-run sample, `train.export_hf`) is gathered
over tp, then over pp, and comes out as the single-process model's; checkpoints write
each rank's part as it is (parallel/pieces.py). The gradient norm adds every stage's share, counting the
tied embedding once; the tied embedding's two copies (first and last stage, stage.py) get
the sum of their gradients. Without pipeline parallelism (pp = 1) every step degenerates to
the tensor-parallel one.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.parallel.tensor.sharding import Placement, TensorShards

TIED = "tok_emb.weight"


class StageShards(TensorShards):
    def __init__(self, module: nn.Module, tp: Communicator, placements: dict[str, Placement],
                 *, pp: Communicator, reference_keys: list[str], tied: bool,
                 ep: Communicator | None = None, ep_placements: dict[str, Placement] | None = None):
        """`reference_keys`: the full model's state-dict keys in order; `tied`: the model ties its embedding and head, and they are on different stages
        (under the V placement both are on stage 0, one tensor: stage.py); `ep`, `ep_placements`: the experts'
        split (tensor/sharding.py)."""
        super().__init__(module, tp, placements, ep=ep, ep_placements=ep_placements)
        self.pp = pp
        self.reference_keys = reference_keys
        ends = pp.size > 1 and pp.rank in (0, pp.size - 1)
        # A frozen table (LoRA's base) has no gradient to exchange: its copies stay equal.
        tied = tied and ends and self.named[TIED].requires_grad
        self.tied_peer = (pp.size - 1 - pp.rank) if tied and ends else None
        # The last stage's copy of the tied embedding: the first stage counts it in the norm.
        self.counted_elsewhere = frozenset({TIED}) if tied and ends and pp.rank > 0 \
            else frozenset()

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def sum_partial_grads(self) -> None:
        super().sum_partial_grads()
        self.sum_tied_grads()

    @torch.no_grad()
    def sum_tied_grads(self) -> None:
        """Both copies of the tied embedding get g_first + g_last (a no-op elsewhere)."""
        if self.tied_peer is not None:
            grad = self.named[TIED].grad
            other = torch.empty_like(grad)
            self.pp.exchange([(self.tied_peer, grad, "tied_grad")],
                             [(self.tied_peer, other, "tied_grad")])
            grad += other

    def grad_norm_squared(self, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        return super().grad_norm_squared(skip | self.counted_elsewhere)

    def sum_norm_squared(self, total: torch.Tensor) -> torch.Tensor:
        """Over tp (and ep), then over the pipeline stages."""
        self.pp.all_reduce(super().sum_norm_squared(total), "sum", tag="grad_norm")
        return total

    # ------------------------------------------------------------------ state

    def full_state_dict(self, local: dict[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in all_gather_objects(self.pp, super().full_state_dict(local)):
            merged.update(part)
        return {k: merged[k] for k in self.reference_keys}


def all_gather_objects(comm: Communicator, obj: object) -> list:
    """Every group rank's `obj` (tensors and plain containers), in group rank order, through
    the communicator: serialised, sizes all-gathered, then the bytes padded to the largest;
    on the communicator's device (an NCCL group takes no CPU tensor). Tensors come back on
    this rank's device: a peer's were saved on the peer's own GPU, and loading them there
    would put a context on another rank's GPU (or fail where only this rank's is visible)."""
    if comm.size == 1:
        return [obj]
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    sizes = torch.empty(comm.size, dtype=torch.int64, device=comm.device)
    comm.all_gather(sizes, torch.tensor([data.numel()], device=comm.device), tag="state")
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=comm.device)
    padded[:data.numel()] = data
    gathered = torch.empty(comm.size, width, dtype=torch.uint8, device=comm.device)
    comm.all_gather(gathered, padded, tag="state")
    gathered, sizes = gathered.cpu(), sizes.cpu()  # the bytes are read on the host
    return [torch.load(io.BytesIO(gathered[r, :int(sizes[r])].numpy().tobytes()),
                       weights_only=True, map_location=comm.device) for r in range(comm.size)]
