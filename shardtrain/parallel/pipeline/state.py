"""What spans the pipeline stages: full state dicts, the tied-embedding gradient, the norm.

`StageShards` is `TensorShards` (one stage's tensor-parallel slices) plus the pipeline
group: full model and optimizer state dicts are gathered over tp, then over pp, and come
out as the single-process model's (its keys; the optimizer's parameter indices in the order
the single-process optimizer numbers them), so checkpoints stay layout-independent;
loading keeps this stage's part. The gradient norm adds every stage's share, counting the
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
                 *, pp: Communicator, reference_keys: list[str],
                 reference_groups: list[list[str]], tied: bool,
                 ep: Communicator | None = None, ep_placements: dict[str, Placement] | None = None):
        """`reference_keys`: the full model's state-dict keys in order; `reference_groups`:
        the parameter names of each of the single-process optimizer's groups, in order;
        `tied`: the model ties its embedding and head; `ep`, `ep_placements`: the experts'
        split (tensor/sharding.py)."""
        super().__init__(module, tp, placements, ep=ep, ep_placements=ep_placements)
        self.pp = pp
        self.reference_keys, self.reference_groups = reference_keys, reference_groups
        ends = pp.size > 1 and pp.rank in (0, pp.size - 1)
        self.tied_peer = (pp.size - 1 - pp.rank) if tied and ends else None
        # The last stage's copy of the tied embedding: the first stage counts it in the norm.
        self.counted_elsewhere = frozenset({TIED}) if tied and ends and pp.rank > 0 \
            else frozenset()
        self._name_of = {p: n for n, p in self.named.items()}

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

    def local_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().local_state_dict({k: state[k] for k in self.model.state_dict()})

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        local = super().full_optimizer_state_dict(optimizer)
        names = self._local_names(optimizer)
        merged: dict[str, dict] = {}
        for part in all_gather_objects(self.pp, {names[i]: s for i, s in local["state"].items()}):
            merged.update(part)
        index = {n: i for i, n in enumerate(n for group in self.reference_groups for n in group)}
        groups = [{**group, "params": [index[n] for n in names_in]}
                  for group, names_in in zip(local["param_groups"], self.reference_groups)]
        return {"state": {index[n]: merged[n] for n in sorted(merged, key=index.get)},
                "param_groups": groups}

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        flat = [n for group in self.reference_groups for n in group]
        by_name = {flat[i]: s for i, s in state["state"].items()}
        names = self._local_names(optimizer)
        groups, start = [], 0
        for saved, group in zip(state["param_groups"], optimizer.param_groups):
            groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        local = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
        super().load_full_optimizer_state_dict(optimizer, {"state": local, "param_groups": groups})

    def _local_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        return [self._name_of[p] for g in optimizer.param_groups for p in g["params"]]


def all_gather_objects(comm: Communicator, obj: object) -> list:
    """Every group rank's `obj` (tensors and plain containers), in group rank order, through
    the communicator: serialised, sizes all-gathered, then the bytes padded to the largest;
    on the communicator's device (an NCCL group takes no CPU tensor)."""
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
                       weights_only=True) for r in range(comm.size)]
