"""Data parallelism with bucketed, overlapped gradient all-reduce (our DDP).

Each parameter's `.grad` is a view into a flat bucket buffer, so accumulation writes
straight into the buffer the all-reduce sends (no copy in, no copy out). Buckets are
filled in reverse registration order, which is roughly the order backward produces
gradients (last layer first). A post-accumulate-grad hook counts the gradients of each
bucket; once a bucket is complete its all-reduce is launched asynchronously while
backward continues with earlier layers (Li et al. 2020, "PyTorch Distributed", sec. 3.2).
Buckets are launched strictly in index order: collectives must be issued in the same
order on every rank, and the order in which gradients become ready may differ.

On accumulation micro-steps (`sync=False`) the hooks do nothing: gradients accumulate
locally and only the last micro-step communicates.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.comm import Communicator, Handle
from shardtrain.comm.compress import make_compressor


@dataclass(eq=False)
class Bucket:
    buffer: torch.Tensor  # flat [numel padded to a multiple of the group size]
    params: list[nn.Parameter]
    pending: int = 0  # gradients still to arrive in this backward
    handle: Handle | None = None


class DataParallel:
    """Averages gradients over `comm`'s group; wraps nothing, only hooks the parameters."""

    def __init__(self, module: nn.Module, comm: Communicator, *, bucket_mb: float = 25.0,
                 compress: str = "none", quant_block: int = 256):
        """`compress`: gradient compression (comm/compress.py), none or int8, one compressor
        per bucket. (comm.compress=topk sparsifies optimizer updates instead of gradients:
        topk.py.)"""
        self.module, self.comm = module, comm
        params = [p for p in module.parameters() if p.requires_grad]  # tied weights once
        self.buckets = _make_buckets(list(reversed(params)), bucket_mb * 2**20, comm.size)
        self.compressors = [make_compressor(compress, block=quant_block) for _ in self.buckets]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next = 0  # index of the next bucket to launch
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._reset_pending()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: no communication inside this context."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero_grad(self) -> None:
        """Zero the bucket buffers (the .grad tensors are views into them; never set them to
        None, or backward would allocate fresh tensors outside the buckets)."""
        for b in self.buckets:
            b.buffer.zero_()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = self.comm.all_reduce(bucket.buffer, "avg", async_op=True, tag="grad",
                                             compress=self.compressors[self._next])
        self._next += 1

    def finish(self) -> None:
        """Wait for every bucket's all-reduce. Buckets whose gradients never all arrived
        (parameters unused in this step, e.g. an expert no token chose) are launched here,
        in order, so every rank issues the same collectives."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._next = 0
        for b in self.buckets:
            b.pending = len(b.params)

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
