"""Which slice of each full parameter a tensor-parallel rank holds, and the model-wide
operations that need it: full (layout-independent) state dicts, loading by slicing,
initialisation, the gradient sums of partially computed gradients, the global grad norm.

A `Placement` says: of the full tensor, zero-padded along `dim` to a multiple of `parts`,
this rank holds block `index` of `parts` equal blocks. parts == tp: a proper shard;
parts == 1: the whole tensor (replicated); 1 < parts < tp: a block shared by tp / parts
ranks (kv heads when there are fewer of them than ranks). Parameters without an entry are
replicated whole.

Expert parallelism adds a second, independent split: the stacked expert weights are cut
along their expert dim over the `ep` group (`ep_placements`), and are whole on every tp
rank (replicated; `partial` over tp under sequence parallelism, whose ranks route different
tokens). A full tensor is sliced over ep first, then over tp; gathered over tp, then ep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shardtrain.comm import Communicator
from shardtrain.config import ModelConfig
from shardtrain.model.transformer import Transformer, init_expert, init_tensor


@dataclass(frozen=True, kw_only=True)
class Placement:
    dim: int = 0
    size: int = 0  # the full tensor's length along dim, before padding
    parts: int = 1
    index: int = 0
    partial: bool = False  # each holder's gradient is a part of the block's gradient

    def block(self) -> int:
        return -(-self.size // self.parts)

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        return tuple(self.size if d == self.dim else n for d, n in enumerate(local))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of `full` (a copy)."""
        if self.parts == 1:
            return full.detach().clone()
        pad = self.block() * self.parts - self.size
        if pad:
            zeros = full.new_zeros(*(pad if d == self.dim else n for d, n in enumerate(full.shape)))
            full = torch.cat([full, zeros], dim=self.dim)
        return full.narrow(self.dim, self.index * self.block(), self.block()).detach().clone()

    def unshard(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from its `parts` blocks, in order."""
        return torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.size)


REPLICATED = Placement()

_STACKED = ("experts.w1", "experts.w2", "experts.w3")  # [E, out, in] (model/moe.py)


def init_block(name: str, place: Placement, shape: torch.Size, seed: int,
               cfg: ModelConfig) -> torch.Tensor:
    """This rank's block of the full initial tensor `name`. A stacked expert weight split
    along its expert dim (expert parallelism) draws only its own experts, each from
    (seed, name, e) (`init_expert`): the same values as the full tensor's slices."""
    if name.endswith(_STACKED) and place.dim == 0:
        first = place.index * place.block()
        return torch.stack([init_expert(name, tuple(shape[1:]), seed, cfg, e)
                            for e in range(first, first + shape[0])])
    if place.parts == 1:  # the whole tensor
        return init_tensor(name, tuple(shape), seed, cfg)
    return place.shard(init_tensor(name, place.full_shape(shape), seed, cfg))


class TensorShards:
    """The placements of one model's parameters over the tensor-parallel group `comm`, and
    of its experts over the expert-parallel group `ep` (None: no expert parallelism)."""

    def __init__(self, model: Transformer, comm: Communicator, placements: dict[str, Placement],
                 *, ep: Communicator | None = None,
                 ep_placements: dict[str, Placement] | None = None):
        self.model, self.comm, self.placements = model, comm, placements
        self.ep, self.ep_placements = ep, ep_placements or {}
        self.named = dict(model.named_parameters())
        # A tied parameter's other names -> its first name.
        first = {id(p): n for n, p in self.named.items()}
        self.tied_to = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                        if first[id(p)] != n}
        self.partial = [(p, placements[n]) for n, p in self.named.items()
                        if placements.get(n, REPLICATED).partial]

    def placement(self, name: str) -> Placement:
        return self.placements.get(name, REPLICATED)

    def ep_placement(self, name: str) -> Placement:
        return self.ep_placements.get(name, REPLICATED)

    def norm_share(self, name: str) -> float:
        """The weight of this rank's copy of `name` in the norm summed over tp and ep: a
        block held by r of the group's n ranks counts r / n on each."""
        share = self.placement(name).parts / self.comm.size
        if self.ep is not None:
            share *= self.ep_placement(name).parts / self.ep.size
        return share

    def levels(self) -> list[tuple[Communicator, Callable[[str], Placement]]]:
        """The splits, innermost first: tp, then ep."""
        levels = [(self.comm, self.placement)]
        return levels + [(self.ep, self.ep_placement)] if self.ep is not None else levels

    def initial_values(self, seed: int, wants: Callable[[str], bool] = lambda n: True
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's block) of each parameter's initial value (`init_tensor` by
        name, so every layout starts from the single-process weights), for the names
        `wants` keeps: one full tensor drawn at a time, then sliced (parallel/build.py)."""
        for name, p in self.named.items():
            if wants(name):
                place = self.ep_placement(name) if name in self.ep_placements else \
                    self.placement(name)  # experts are whole over tp
                yield name, init_block(name, place, p.shape, seed, self.model.cfg)

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def sum_partial_grads(self) -> None:
        """Sum the gradient parts of blocks held by several ranks: the norms (and row-parallel
        biases) under sequence parallelism see 1/t of the tokens; a shared kv head sees the
        query heads of one rank. One all-reduce: each rank writes its part at its block's
        offset of a zeroed [parts, numel] segment. Parameters without a gradient (the same
        on every rank) are skipped."""
        self.sum_partial([(p.grad, place) for p, place in self.partial if p.grad is not None])

    def sum_partial(self, parts: list[tuple[torch.Tensor, Placement]]) -> None:
        """Sum each gradient part (a tensor, or the same slice of one on every tp rank: ZeRO
        shards) over the ranks holding the same block, in place."""
        if not parts:
            return
        segments = []
        for g, place in parts:
            seg = g.new_zeros(place.parts, g.numel())
            seg[place.index] = g.flatten()
            segments.append(seg)
        flat = torch.cat([s.flatten() for s in segments])
        self.comm.all_reduce(flat, "sum", tag="grad")
        offset = 0
        for (g, place), seg in zip(parts, segments):
            start = offset + place.index * g.numel()
            g.copy_(flat[start:start + g.numel()].view_as(g))
            offset += seg.numel()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The L2 norm of the full model's gradient; scales gradients to at most `max_norm`."""
        total = self.grad_norm_squared().sqrt()
        if max_norm < float("inf"):
            grads = [p.grad for p in self.named.values() if p.grad is not None]
            torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
        return total

    @torch.no_grad()
    def grad_norm_squared(self, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        """The squared L2 norm of the gradients this rank's tp group holds, parameters in
        `skip` left out. A block held by r ranks counts 1/r on each; the tp ranks' sums are
        added."""
        # Grouped by share, each group's sum scaled by a Python float: a per-parameter share
        # vector would be a list copied to the device at every clip, blocking the host.
        groups: dict[float, list[torch.Tensor]] = {}
        for n, p in self.named.items():
            if p.grad is not None and n not in skip:
                groups.setdefault(self.norm_share(n), []).append(p.grad)
        sums = [torch.stack(torch._foreach_norm(grads)).float().square().sum() * share
                for share, grads in groups.items()]  # [P] norms per group, summed
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.comm.device)
        return self.sum_norm_squared(total)

    def sum_norm_squared(self, total: torch.Tensor) -> torch.Tensor:
        """A squared norm summed over the ranks holding the other shards (in place)."""
        for comm, _ in self.levels():
            comm.all_reduce(total, "sum", tag="grad_norm")
        return total

    # ------------------------------------------------------------------ state

    def full_state_dict(self, local: dict[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        """The model's state dict as one process would hold it (collective over tp), from
        this rank's tensors: the model's own, or `local` (ZeRO: from its master shards; tied
        parameters under their first name only; frozen ones are not in it)."""
        state = self.model.state_dict()
        if local is not None:  # tensors `local` lacks (frozen: LoRA's base) are the module's
            state = {k: local.get(k, local.get(self.tied_to.get(k), v)) for k, v in state.items()}
        for comm, place in self.levels():
            state = self._gather({k: (v, place(k)) for k, v in state.items()}, comm)
        return state

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full tensor `name` (sliced over ep, then tp)."""
        for _, place in reversed(self.levels()):
            full = place(name).shard(full)
        return full

    def _gather(self, items: dict, comm: Communicator) -> dict:
        """{key: (local tensor, placement)} -> {key: full tensor}: the sharded ones in one
        all-gather over `comm` per dtype; a block comes from the first rank holding it."""
        out = {k: v.detach().clone() for k, (v, place) in items.items() if place.parts == 1}
        sharded = [k for k, (_, place) in items.items() if place.parts > 1]
        for dtype in dict.fromkeys(items[k][0].dtype for k in sharded):  # same order everywhere
            keys = [k for k in sharded if items[k][0].dtype == dtype]
            local = torch.cat([items[k][0].detach().flatten() for k in keys])
            gathered = local.new_empty(comm.size, local.numel())  # [t, n]
            comm.all_gather(gathered, local, tag="state")
            offset = 0
            for k in keys:
                v, place = items[k]
                ranks = range(0, comm.size, comm.size // place.parts)
                out[k] = place.unshard([gathered[r, offset:offset + v.numel()].view(v.shape)
                                        for r in ranks])
                offset += v.numel()
        return {k: out[k] for k in items}
