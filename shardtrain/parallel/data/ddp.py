"""Data parallelism with bucketed, overlapped gradient all-reduce (our DDP).

Each parameter's `.grad` is a view into a flat bucket buffer, so accumulation writes
straight into the buffer the all-reduce sends (no copy in, no copy out). Buckets are
filled in reverse registration order, which is roughly the order backward produces
gradients (last layer first). Once a bucket is complete its all-reduce is launched
asynchronously while backward continues with earlier layers, buckets strictly in index
order (ready.py; Li et al. 2020, "PyTorch Distributed", sec. 3.2).

On accumulation micro-steps (`no_sync`) nothing is launched: gradients accumulate locally
and only the last micro-step communicates. Buffers hold the fp32 main gradients
(precision.py); with a bf16 reduce dtype a bucket travels as a bf16 copy, averaged back in.

`ReplicatedUpdate` is the layout's update half (strategy.py) for plain data parallelism:
this reducer, a torch optimizer over the full (tensor-parallel local) parameters, and the
clipping and gradient sums over the tensor and pipeline shards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.comm import Communicator, Handle
from shardtrain.ckpt.files import Piece, Reader
from shardtrain.comm.compress import make_compressor
from shardtrain.parallel.pieces import (load_torch_optimizer, local_model_state, local_tensor,
                                       module_pieces, optimizer_steps, tensor_piece,
                                       torch_optimizer_pieces)
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.replica.view import KeyOf, ReplicaView
from shardtrain.parallel.ready import ReadyInOrder
from shardtrain.parallel.strategy import nbytes, optimizer_state_bytes


@dataclass(eq=False)
class Bucket:
    buffer: torch.Tensor  # flat [numel padded to a multiple of the group size]
    params: list[nn.Parameter]
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # [numel] the reduce-dtype copy in flight, if not buffer


class DataParallel:
    """Averages gradients over `comm`'s group; wraps nothing, only hooks the parameters."""

    def __init__(self, module: nn.Module, comm: Communicator, *, bucket_mb: float = 25.0,
                 compress: str = "none", quant_block: int = 256,
                 reduce_dtype: torch.dtype = torch.float32,
                 params: list[nn.Parameter] | None = None,
                 arrivals: dict[nn.Parameter, int] | None = None):
        """`params`: the parameters to reduce (default: all of the module's that train;
        expert parallelism gives its experts a reducer of their own). `compress`: gradient
        compression (comm/compress.py), none or int8, one compressor per bucket
        (comm.compress=topk sparsifies optimizer updates instead of gradients: topk.py).
        `reduce_dtype`: the dtype gradients travel in (the policy's). `arrivals`: parameters
        that two pipeline chunks of this rank use (ready.py)."""
        self.module, self.comm, self.reduce_dtype = module, comm, reduce_dtype
        if params is None:
            params = [p for p in module.parameters() if p.requires_grad]  # tied weights once
        self.buckets = _make_buckets(list(reversed(params)), bucket_mb * 2**20, comm.size)
        self.compressors = [make_compressor(compress, block=quant_block) for _ in self.buckets]
        self.launcher = ReadyInOrder([b.params for b in self.buckets], self._launch, arrivals)

    def no_sync(self) -> AbstractContextManager:
        """Accumulate gradients locally: no communication inside this context."""
        return self.launcher.paused()

    def zero_grad(self) -> None:
        """Zero the bucket buffers (the .grad tensors are views into them; never set them to
        None, or backward would allocate fresh tensors outside the buckets)."""
        for b in self.buckets:
            b.buffer.zero_()

    def _launch(self, i: int) -> None:
        b = self.buckets[i]
        b.wire = b.buffer if b.buffer.dtype == self.reduce_dtype else b.buffer.to(self.reduce_dtype)
        b.handle = self.comm.all_reduce(b.wire, "avg", async_op=True, tag="grad",
                                        compress=self.compressors[i])

    def finish(self) -> None:
        """Wait for every bucket's all-reduce (launching those whose gradients never all
        arrived, in order)."""
        self.launcher.drain()
        for b in self.buckets:
            b.handle.wait()
            if b.wire is not b.buffer:
                b.buffer.copy_(b.wire)
            b.handle, b.wire = None, None
        self.launcher.reset()

    @property
    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)


FIRST_BUCKET_BYTES = 2**20


def _make_buckets(params: list[nn.Parameter], cap_bytes: float, group_size: int) -> list[Bucket]:
    """Greedy packing in the given order; a bucket closes once it holds >= its cap. The first
    bucket's cap is at most 1 MiB so that communication starts early in backward (as torch
    DDP does). Each buffer is padded to a multiple of the group size so ring chunks are equal."""
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        cap = min(cap_bytes, FIRST_BUCKET_BYTES) if len(groups) == 1 else cap_bytes
        if groups[-1] and (size >= cap or p.dtype != groups[-1][0].dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for group in groups:
        numel = sum(p.numel() for p in group)
        padded = -(-numel // group_size) * group_size
        buffer = torch.zeros(padded, dtype=group[0].dtype, device=group[0].device)
        offset = 0
        for p in group:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        buckets.append(Bucket(buffer=buffer, params=group))
    return buckets


class ReplicatedUpdate:
    """The update half of plain data parallelism: gradients all-reduced in buckets, summed
    over tensor-parallel shards, clipped over the whole model, one torch optimizer step.
    Checkpoints hold the module's tensors and the optimizer's state as they are
    (parallel/pieces.py)."""

    def __init__(self, reducer: DataParallel, optimizer: torch.optim.Optimizer,
                 shards: StageShards):
        self.reducer, self.optimizer, self.shards = reducer, optimizer, shards
        self.no_sync, self.zero_grad = reducer.no_sync, reducer.zero_grad

    def finish(self) -> None:
        self.reducer.finish()
        self.shards.sum_partial_grads()

    def clip_grad_norm(self, max_norm: float, unscale: float = 1.0) -> torch.Tensor:
        """The all-reduced gradients are the same on every dp rank, and so is their norm
        (summed over tp and pp): a non-finite one is non-finite everywhere."""
        if unscale != 1.0:
            for b in self.reducer.buckets:
                b.buffer.mul_(unscale)
        return self.shards.clip_grad_norm(max_norm)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def replica_view(self) -> ReplicaView:
        """parallel/replica/view.py: the buckets' buffers hold every gradient the optimizer
        reads (p.grad are views of them); the parameters it updates are their own masters."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        name_of = {p: n for n, p in self.shards.named.items()}

        def load(reader: Reader, key_of: KeyOf, tensors: list[torch.Tensor]) -> bool:
            if not any(reader.has(key_of(name_of[p])) for p in params):
                return False
            for p, t in zip(params, tensors, strict=True):
                t.copy_(local_tensor(self.shards, reader, key_of(name_of[p]), name_of[p], p,
                                     torch.float32))
            return True

        return ReplicaView(
            grads=lambda: [b.buffer for b in self.reducer.buckets], weights=params,
            refresh=lambda: None,
            pieces=lambda key_of, tensors: [tensor_piece(self.shards, key_of(name_of[p]),
                                                         name_of[p], t)
                                            for p, t in zip(params, tensors, strict=True)],
            load=load)

    def memory(self) -> dict[str, int]:
        """Parameters are the fp32 master weights (bf16 and fp16 compute under autocast)."""
        return {"params_bytes": nbytes(*self.shards.model.parameters()),
                "grads_bytes": self.reducer.grad_bytes,
                "optimizer_bytes": optimizer_state_bytes(self.optimizer), "master_bytes": 0}

    def local_state_dict(self) -> None:
        return None  # the module's own parameters are this rank's state

    def state_pieces(self) -> list[Piece]:
        return module_pieces(self.shards) + torch_optimizer_pieces(self.shards, self.optimizer)

    def optim_steps(self) -> int:
        return optimizer_steps(self.optimizer)

    def load_state(self, reader: Reader, steps: int) -> None:
        self.shards.model.load_state_dict(local_model_state(self.shards, reader))
        load_torch_optimizer(self.shards, self.optimizer, reader, steps)

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        return {}  # all of it is in the pieces

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        pass
