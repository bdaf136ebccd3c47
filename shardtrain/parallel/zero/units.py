"""ZeRO's flat units and how their bytes move.

A unit is a group of parameters gathered, reduced and updated together: the embedding
(token and learned position tables), each transformer block (the last one with the final
norm), and the output head; tied embeddings join the head's unit, so the shared matrix is
counted once (cost/units.py, the one place the grouping is decided, says why).
Like FSDP's FlatParameter (Zhao et al. 2023, sec. 3.2), a unit's parameters are views into
one flat buffer [padded], padded to a multiple of the dp size so that every rank owns an
equal contiguous shard [padded / dp]: rank r owns elements [r * shard, (r + 1) * shard).

A unit is sharded over the group of ranks that replicate its parameters, and knows it
(`FlatUnit.comm`): the replica group (dp, or dp x cp) for every parameter of a dense model.
Under expert parallelism the experts are replicated only over the expert-data-parallel
group (edp: the ranks holding the same experts), so a block's experts form a unit of their
own, sharded over edp, right after the block's other parameters (DeepSpeed-MoE,
Rajbhandari et al. 2022, shards expert states over that group the same way).

Under ZeRO-3 with a 16-bit compute dtype (`gather_dtype`) a unit is split in two
(cost/units.py): the parameters autocast rounds before every use are gathered in the
compute dtype -- their flat buffer is 16-bit, their shard stays the fp32 master, rounded as
it is sent (FSDP2's `param_dtype` for exactly the parameters whose rounding changes no
number) -- and the others in fp32.

`UnitComm` is the one place a unit's parameters are all-gathered and its gradients
reduce-scattered, over one group: ZeRO++ (Wang et al. 2023: int8 weights, hpZ's node-local
secondary shard, int8 gradients over all-to-all) replaces it with a subclass.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.comm import Communicator, Handle
from shardtrain.cost.units import layer_owners, unit_key
from shardtrain.parallel.zero.optim import Runs
from shardtrain.parallel.tensor.sharding import Placement


@dataclass(eq=False)
class FlatUnit:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]  # of each parameter in the flat buffer
    padded: int  # elements of the flat buffer, a multiple of the group size
    shard_numel: int
    rank: int  # group rank: owner of elements [rank * shard_numel, (rank + 1) * shard_numel)
    # (layer partition: 0, the owner's shard the whole unit, the others' empty)
    flat: torch.Tensor  # [padded] the full parameters (ZeRO-3: storage freed at rest; in
    # the gather dtype, 16-bit for a split unit's rounded half)
    shard: torch.Tensor  # [shard] this rank's slice of the parameters (param dtype, fp32)
    grad_shard: torch.Tensor | None = None  # [shard] fp32, reduced over comm (ZeroReducer)
    grad_flat: torch.Tensor | None = None  # [padded] ZeRO-1: the full gradients
    comm: UnitComm | None = None  # the collectives over the group sharding it (None: layout only)
    key: tuple[int, int, int] = (0, 0, 0)  # forward order (unit_key)
    sharded: bool = False  # ZeRO-3: the flat buffer has storage only while gathered
    owner: int | None = None  # layer partition: the group rank holding the whole unit
    blocks: int = 1  # transformer blocks per unit (parallel.zero_unit_blocks; key[1] % it == 0)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def shard_slice(self) -> slice:
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    def shard_runs(self, keep) -> list[tuple[int, int, int]]:
        """(param index, start, end) of the parameters with keep(i) inside this rank's shard,
        shard-relative."""
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b and keep(i):
                out.append((i, a - lo, b - lo))
        return out

    def decay_runs(self) -> Runs:
        """Where weight decay applies: matrices, as train/optim.py groups them."""
        return [(a, b) for _, a, b in self.shard_runs(lambda i: self.params[i].ndim >= 2)]

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a [padded] buffer, in its shape."""
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def holds(self, i: int) -> bool:
        """Whether this rank keeps any of parameter i's values (sharded: its shard overlaps
        them)."""
        return not self.sharded or bool(self.shard_runs(lambda j: j == i))

    @torch.no_grad()
    def write(self, i: int, value: torch.Tensor) -> None:
        """Set parameter i to `value` (its full local tensor, any device): into the flat
        buffer, or (sharded) into the part of this rank's shard that covers it."""
        if not self.sharded:
            self.param_views(self.flat)[i].copy_(value)
            return
        off, flat = self.offsets[i], value.reshape(-1)
        for _, a, b in self.shard_runs(lambda j: j == i):  # shard-relative [a, b)
            start = self.rank * self.shard_numel + a - off
            self.shard[a:b].copy_(flat[start:start + b - a])


def merge_units(*groups: list[FlatUnit]) -> list[FlatUnit]:
    """Units of several groups in one forward order; on equal keys (a block's dense and
    expert units) the earlier group's unit first. Backward then completes the experts'
    unit before the rest of their block (the router and attention come after in backward)."""
    units = sorted((u for g in groups for u in g), key=lambda u: u.key)  # stable
    for index, u in enumerate(units):
        u.index = index
    return units


@torch.no_grad()
def build_units(model: nn.Module, *, dp_size: int, dp_rank: int, dtype: torch.dtype,
                tied: bool, align: int = 1, comm: UnitComm | None = None,
                only: Collection[nn.Parameter] | None = None,
                skip: Collection[nn.Parameter] = (), sharded: bool = False,
                device: torch.device | None = None,
                gather_dtype: torch.dtype | None = None, blocks: int = 1,
                partition: str = "flat") -> list[FlatUnit]:
    """Group the model's parameters (tied ones once; those in `only` if given, not those in
    `skip`) into units in forward order, sharded over `comm`'s group of `dp_size` ranks
    (this one `dp_rank`), and make every parameter a view of its unit's flat buffer.
    `sharded` (ZeRO-3): only this rank's shard keeps storage; the flat buffer is emptied
    until a gather (gather.py). Otherwise the flat buffer holds the whole unit. A parameter
    that holds values has them copied in (its shard's part, when sharded); one still on the
    meta device (parallel/build.py) is filled later through `FlatUnit.write`, so no rank
    ever holds a unit's values twice. `align`: each parameter starts, and each rank's
    shard is sized, at a multiple of it (zero gaps between), so that blocks of `align`
    values counted from a shard's start never straddle two parameters -- qwZ's quantization
    blocks: one scale for a norm's ~1.0 values and a matrix's ~0.02 would round the matrix
    away. `gather_dtype` (sharded only; the compute dtype when it is 16-bit): units split,
    their rounded halves' flat buffers in it (module docstring). `blocks`: transformer
    blocks per unit (parallel.zero_unit_blocks; cost/units.py `unit_key`). `partition`
    "layer" (sharded only): each unit whole on one rank of the group (cost/units.py
    `layer_owners`), padded only to `align`; the others hold an empty shard (layer.py)."""
    split = sharded and gather_dtype is not None and gather_dtype != dtype
    groups: dict[tuple[int, int, int], list[tuple[str, nn.Parameter]]] = {}
    n_layers = model.cfg.n_layers  # the whole model's: a pipeline stage keeps global names
    for name, p in model.named_parameters():
        if p.requires_grad and (only is None or p in only) and p not in skip:
            key = unit_key(name, tied=tied, n_layers=n_layers, rounded=split, blocks=blocks)
            groups.setdefault(key, []).append((name, p))
    units, layer = [], partition == "layer"
    layouts = [_offsets(groups[key], align) for key in sorted(groups)]
    owners = layer_owners([total for _, total in layouts], dp_size) if layer else []
    for index, key in enumerate(sorted(groups)):
        named, (offsets, total) = groups[key], layouts[index]
        chunks = 1 if layer else dp_size  # equal shards the unit is cut into
        padded = -(-total // (chunks * align)) * chunks * align
        at = device or named[0][1].device
        shard_numel, rank = padded // dp_size, dp_rank
        if layer:  # the owner's shard is the unit, chunk 0 of 1; the others' empty
            shard_numel, rank = padded if owners[index] == dp_rank else 0, 0
        if sharded:  # the shard [padded / dp] its own; the flat buffer only while views are
            # taken (a view needs the bytes to exist; on CPU its pages are never touched)
            flat = torch.empty(padded, dtype=gather_dtype if key[2] else dtype, device=at)
            shard = torch.zeros(shard_numel, dtype=dtype, device=at)
        else:
            flat = torch.zeros(padded, dtype=dtype, device=at)
            shard = flat[rank * shard_numel:(rank + 1) * shard_numel]
        unit = FlatUnit(index=index, names=[n for n, _ in named], params=[p for _, p in named],
                        offsets=offsets, padded=padded, shard_numel=shard_numel,
                        rank=rank, flat=flat, shard=shard, comm=comm, key=key,
                        sharded=sharded, owner=owners[index] if layer else None,
                        blocks=blocks)
        for i, (p, view) in enumerate(zip(unit.params, unit.param_views(flat))):
            if p.is_meta:  # onto the device, the same object (ties and references hold)
                empty = torch.empty(0, dtype=flat.dtype, device=at)
                torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
            else:
                unit.write(i, p.detach())
            # .data, not a swap: the parameter keeps a version counter of its own, so a
            # gather into the flat buffer does not invalidate what autograd saved of it (a
            # split unit's rounded half: the parameter takes the 16-bit dtype too)
            p.data = view
        if sharded:
            flat.untyped_storage().resize_(0)
        units.append(unit)
    return units


def _offsets(named: list[tuple[str, nn.Parameter]], align: int) -> tuple[list[int], int]:
    """Each parameter's offset in its unit's flat buffer (each at a multiple of `align`),
    and the elements they span."""
    offsets, total = [], 0
    for _, p in named:
        total = -(-total // align) * align
        offsets.append(total)
        total += p.numel()
    return offsets, total


def on_wire(shard: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The shard as a gather into `full` sends it: rounded to full's dtype (a split unit's
    16-bit half: the fp32 master rounded once per gather), else itself."""
    return shard if shard.dtype == full.dtype else shard.to(full.dtype)


def partial_runs(unit: FlatUnit, placements: dict[str, Placement]
                 ) -> list[tuple[Placement, int, int]]:
    """(placement, start, end) of the shard's slices of tensor-parallel blocks whose
    gradient is a part to be summed over tp (tensor/sharding.py)."""
    return [(placements[unit.names[i]], a, b) for i, a, b in
            unit.shard_runs(lambda i: unit.names[i] in placements
                            and placements[unit.names[i]].partial)]


class UnitComm:
    """The all-gather of a unit's parameters and the reduce-scatter of its gradients over
    its group. `phase` says why a gather happens: "forward" or "backward" (ZeRO-3) or
    "step" (ZeRO-1/2, after the optimizer step), so a variant can route them differently
    (hpZ gathers backward from a node-local copy). `grad_scale`: the factor the group's
    average of a gradient still needs to be the gradient of the batch's mean loss (1, and
    for the experts over edp expert/reduce.py `expert_grad_scale`)."""

    def __init__(self, comm: Communicator, *, grad_scale: float = 1.0):
        self.comm, self.grad_scale = comm, grad_scale

    def gather_params(self, unit: FlatUnit, full: torch.Tensor, shard: torch.Tensor, *,
                      phase: str, async_op: bool = True) -> Handle:
        """full [padded] <- every rank's shard [padded / dp], sent in full's dtype."""
        return self.comm.all_gather(full, on_wire(shard, full), async_op=async_op,
                                    tag="param")

    def reduce_grads(self, shard: torch.Tensor, full: torch.Tensor, *,
                     async_op: bool = True) -> Handle:
        """shard [n] <- this rank's chunk of the dp average of full [dp * n] (one unit's
        gradient, or a bucket's: zero/buckets.py)."""
        return self.comm.reduce_scatter(shard, full, "avg", async_op=async_op, tag="grad")

    def gather_state(self, unit: FlatUnit, full: torch.Tensor, master: torch.Tensor) -> None:
        """full [padded] fp32 <- every rank's fp32 master shard (full state dicts)."""
        self.comm.all_gather(full, master, tag="state")

    @property
    def held_param_bytes(self) -> int:
        """Parameter bytes kept between collectives (hpZ's secondary shards; none here)."""
        return 0
