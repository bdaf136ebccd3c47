"""The communication operators of tensor and sequence parallelism, as autograd functions.

Shoeybi et al. 2019 (Megatron-LM, sec. 3) place two conjugate operators around each
parallel region: `f` is the identity in forward and an all-reduce in backward (it enters a
region whose column-parallel linears each see only part of the input's gradient); `g` is
an all-reduce in forward and the identity in backward (it leaves a region through a
row-parallel linear whose outputs are partial sums). Korthikanti et al. 2022 (sec. 4.2.2)
split each all-reduce into a reduce-scatter and an all-gather along the sequence so the
norms between regions work on 1/t of the tokens: `g` becomes a reduce-scatter (backward:
all-gather) and `f` an all-gather (backward: reduce-scatter).

Every collective goes through the tensor-parallel Communicator with tag "tp", inside a
custom op (torch.library) that torch.compile sees as one opaque node with a known output
shape: a compiled block (train.compile, parallel/compile.py) then traces each region whole,
the collectives included, into one graph, instead of breaking at each into the Python of
the Communicator. A custom op takes tensors and plain values only, so it names its
communicator by a handle (`handle`). Tensors are [B, S, C] with the sequence on dim 1; a
rank's sequence chunk is chunk `rank` of t.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd import Function

from shardtrain.comm import Communicator

TAG = "tp"

# handle -> Communicator. The handle is passed explicitly in every op call (as torch's own
# functional collectives pass a group name); the table only turns it back into the object,
# and holds none alive.
_COMMS: weakref.WeakValueDictionary[str, Communicator] = weakref.WeakValueDictionary()


def handle(comm: Communicator) -> str:
    """The name the ops below reach `comm` by, for as long as it lives."""
    key = f"{comm.name}@{id(comm):x}"
    _COMMS[key] = comm
    return key


def _size(comm: str) -> int:
    return _COMMS[comm].size


@torch.library.custom_op("shardtrain::tp_all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, comm: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    _COMMS[comm].all_reduce(out, "sum", tag=TAG)
    return out


@torch.library.custom_op("shardtrain::tp_all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, comm: str) -> torch.Tensor:
    """The max over the group of fp8 amaxes (quant/float8_tp.py), on the ledger as tp:amax."""
    out = x.clone(memory_format=torch.contiguous_format)
    _COMMS[comm].all_reduce(out, "max", tag=f"{TAG}:amax")
    return out


@torch.library.custom_op("shardtrain::tp_gather_sequence", mutates_args=())
def gather_sequence(x: torch.Tensor, comm: str) -> torch.Tensor:
    """[B, S/t, C] chunks of every rank -> [B, S, C]."""
    c = _COMMS[comm]
    out = x.new_empty(c.size, *x.shape)  # [t, B, S/t, C]
    c.all_gather(out, x.contiguous(), tag=TAG)
    return out.transpose(0, 1).flatten(1, 2).contiguous()  # [B, S, C]


@torch.library.custom_op("shardtrain::tp_regather_sequence", mutates_args=())
def regather_sequence(x: torch.Tensor, comm: str) -> torch.Tensor:
    """`gather_sequence` again, in backward: a separate op, so that a compiled graph's common
    subexpressions merge the re-gathers of one region's linears (one per region, as
    GatheredInput makes it eagerly) but never with the forward's gather (which would keep
    the gathered input alive through the whole block, the memory sp saves)."""
    return gather_sequence(x, comm)


@torch.library.custom_op("shardtrain::tp_reduce_scatter_sequence", mutates_args=())
def reduce_scatter_sequence(x: torch.Tensor, comm: str) -> torch.Tensor:
    """[B, S, C] partial sums on every rank -> this rank's [B, S/t, C] chunk of their sum."""
    c = _COMMS[comm]
    chunks = x.unflatten(1, (c.size, -1)).transpose(0, 1).contiguous()  # [t, B, S/t, C]
    out = x.new_empty(chunks.shape[1:])
    c.reduce_scatter(out, chunks, "sum", tag=TAG)
    return out


@all_reduce.register_fake
@all_reduce_max.register_fake
def _(x: torch.Tensor, comm: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@gather_sequence.register_fake
@regather_sequence.register_fake
def _(x: torch.Tensor, comm: str) -> torch.Tensor:
    b, s, *rest = x.shape
    return x.new_empty(b, s * _size(comm), *rest)


@reduce_scatter_sequence.register_fake
def _(x: torch.Tensor, comm: str) -> torch.Tensor:
    b, s, *rest = x.shape
    return x.new_empty(b, s // _size(comm), *rest)


def sequence_chunk(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's chunk [B, S/t, C] of a replicated [B, S, C] (a copy, not a view)."""
    if x.shape[1] % comm.size:
        raise ValueError(f"sequence parallelism: sequence length {x.shape[1]} is not divisible "
                         f"by the tensor-parallel degree {comm.size}")
    return x.chunk(comm.size, dim=1)[comm.rank].clone()


class CopyToRegion(Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: str) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.comm), None


class ReduceFromRegion(Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: str) -> torch.Tensor:
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatheredInput:
    """The all-gathered input of a sequence-parallel region, rebuilt once in backward.

    The column-parallel linears of the region save only this rank's sequence chunk; the
    first of them to run backward all-gathers it again, the others reuse that, and the
    region's entry drops it once their gradients are summed (Korthikanti et al. 2022,
    sec. 4.2.2: an extra all-gather in backward instead of t times the activation).
    Eager only: a compiled region re-gathers in each linear's backward, and the graph's
    common subexpressions make that one all-gather (`regather_sequence`)."""

    def __init__(self, comm: str):
        self.comm = comm
        self.full: torch.Tensor | None = None

    def rebuild(self, chunk: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = regather_sequence(chunk, self.comm)
        return self.full


class GatherFromSequence(Function):
    """Sequence-parallel f: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: str, gathered: GatheredInput | None
                ) -> torch.Tensor:
        ctx.comm, ctx.gathered = comm, gathered
        return gather_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.gathered is not None:
            ctx.gathered.full = None  # every consumer of the region's input has run backward
        return reduce_scatter_sequence(grad, ctx.comm), None, None


class ReduceScatterToSequence(Function):
    """Sequence-parallel g: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: str) -> torch.Tensor:
        ctx.comm = comm
        return reduce_scatter_sequence(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_sequence(grad, ctx.comm), None


class ScatterToSequence(Function):
    """Enter the sequence-parallel residual stream: keep this rank's chunk of a replicated
    activation (no communication); backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: str) -> torch.Tensor:
        ctx.comm = comm
        return sequence_chunk(x, _COMMS[comm])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_sequence(grad, ctx.comm), None
