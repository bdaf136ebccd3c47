"""Activation offload (train.activation_offload = cpu): what each transformer block saves
for backward goes to host memory as the forward moves on and comes back one block ahead of
its backward.

Each block's forward runs under torch.autograd.graph.saved_tensors_hooks. The pack hook
copies a saved tensor's whole storage (once per storage and block: two views of one
storage share one copy, as `SavedActivations` counts them) into a host buffer and hands
autograd a small handle instead of the tensor; the unpack hook rebuilds the tensor (same
dtype, offset, sizes, strides) over the storage reloaded on the device. Weights, buffers
and the block's extra arguments (RoPE tables, a document mask) are left on the device: the
rule is `activation.WeightFilter`'s, the one the planner's per-layer bytes are measured
with (plan/activations.py), so the bytes moved equal the planner's term.

Order (the trace records it): block i's storages go down while block i runs; when block
i's output gradient arrives (a tensor hook: block i's backward is about to start), the
device copies of block i + 1 are dropped (its backward is done), block i is made ready and
block i - 1's reload starts, so each reload overlaps the backward of the block after it.
The chain links a block to the one whose output was its input, so micro-batches in flight
(pipeline schedules) and virtual stages each keep their own chain. A split backward
(zero-bubble schedules: split_backward.py) runs W after B from the kept graph: W's unpacks
reload what B's window has already dropped, on demand, from the host copies that live
until the graph is freed.

Recomputation composes: a non-reentrant checkpoint's region saves through its own hooks
(innermost wins), so what is recomputed is never offloaded; only the checkpoint's inputs
(selective: q, k, v; full: the block input) reach these hooks.

On CUDA the copies run on a side stream into pinned buffers: the side stream waits for the
compute stream before each copy down, the source's block is recorded on the side stream
(the allocator will not reuse it before the copy), and a block starting waits (on the
host: `_retire` says why) for the copies of the block two back, so at most about two blocks
of activations are on the device in forward; reloads are events the compute stream waits
on at first use. On a CPU host and device are one: the copies are plain memcpys and save
nothing, but the mechanism, its order and its bytes are the same.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

import torch
from torch import nn

from shardtrain.parallel.activation import WeightFilter, tensors_of


class _Block:
    """One block's forward for one micro-batch: its storages on the host (and, while in
    the window, on the device)."""

    def __init__(self, owner: ActivationOffload, index: int, chain: int,
                 prev: _Block | None):
        self.owner, self.index, self.chain, self.prev = owner, index, chain, prev
        self.next: weakref.ref | None = None  # the block after this one in the chain
        self.out: weakref.ref | None = None  # this block's output (the next block's input)
        self.host: dict[int, torch.Tensor] = {}  # storage key -> host uint8 copy
        self.sources: list[torch.Tensor] = []  # device storages held while the block runs
        self.device: dict[int, torch.Tensor] | None = None  # reloaded storages
        self.down: torch.cuda.Event | None = None  # the copies down are done
        self.up: torch.cuda.Event | None = None  # the reload is done
        self.bytes = 0
        self.unpacked = False

    def __del__(self) -> None:  # the graph that held the handles is gone
        self.owner._account(host=-self.bytes, device=-self.bytes if self.device else 0)


class _Handle:
    """What autograd keeps in place of a saved tensor."""

    __slots__ = ("block", "key", "dtype", "offset", "size", "stride")

    def __init__(self, block: _Block, key: int, t: torch.Tensor):
        self.block, self.key, self.dtype = block, key, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class ActivationOffload:
    """Installs the hooks on blocks (`install`) and keeps the figures the memory ledger
    reports: bytes moved down and up, and the peaks of what the host and the device
    window hold. `trace` (a list, for tests and debugging): ("offload" | "reload" |
    "unpack" | "release", chain, block index) in the order they happen."""

    def __init__(self, device: torch.device, trace: list | None = None):
        self.device, self.trace = device, trace
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.offloaded_bytes = self.reloaded_bytes = 0
        self.host_bytes = self.host_peak = self.device_bytes = self.device_peak = 0
        self._pending: collections.deque[_Block] = collections.deque()  # copies not waited
        self._last: weakref.ref | None = None  # the block that ran last
        self._chains = 0

    def install(self, blocks: nn.ModuleList) -> None:
        """Run each block's forward (as it is now: a checkpoint stays inside) under the
        hooks; the block's index in `blocks` orders its chain."""
        for i, block in enumerate(blocks):
            block.forward = functools.partial(self._run, i, block, block.forward)

    def ledger(self) -> dict[str, int]:
        return {"activation_offload_down_bytes": self.offloaded_bytes,
                "activation_offload_up_bytes": self.reloaded_bytes,
                "activation_offload_host_peak_bytes": self.host_peak,
                "activation_offload_device_peak_bytes": self.device_peak}

    # forward ------------------------------------------------------------------------------

    def _run(self, index: int, block: nn.Module, forward: Any, x: torch.Tensor,
             *args: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation and sampling keep nothing
            return forward(x, *args)
        last = self._last() if self._last is not None else None
        linked = last is not None and last.out is not None and last.out() is x
        if not linked:
            self._chains += 1
        rec = _Block(self, index, self._chains, last if linked else None)
        if linked:
            last.next = weakref.ref(rec)
        self._retire(keep=1)  # the block two back: its copies done before this one runs
        keep = WeightFilter(block, tensors_of(args))
        with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self._pack, rec, keep), self._unpack):
            out = forward(x, *args)
        if self.cuda:
            rec.down = self.side.record_event()
        rec.sources.clear()  # (on CUDA the allocator waits for the side stream)
        self._pending.append(rec)
        self._log("offload", rec)
        rec.out, self._last = weakref.ref(out), weakref.ref(rec)
        if out.requires_grad:
            out.register_hook(functools.partial(self._on_grad, weakref.ref(rec)))
        return out

    def _pack(self, rec: _Block, keep: WeightFilter, t: torch.Tensor) -> Any:
        if type(t) is not torch.Tensor or t.device.type == "meta" or not t.numel() or keep(t):
            return t  # weights, buffers, arguments and tensor subclasses stay as they are
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in rec.host:
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # [bytes]
            rec.sources.append(src)  # its address is not reused while the block runs
            rec.host[key] = self._copy(src, torch.device("cpu"), rec_stream=True)
            rec.bytes += src.numel()
            self.offloaded_bytes += src.numel()
            self._account(host=src.numel(), device=src.numel())
        return _Handle(rec, key, t)

    def _copy(self, src: torch.Tensor, to: torch.device, *, rec_stream: bool) -> torch.Tensor:
        """src [bytes] copied to `to`; on CUDA on the side stream, after the compute
        stream's work so far (pinned host buffers: the copy is asynchronous)."""
        if not self.cuda:
            return src.clone()  # host and device are one: a copy all the same
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            dst = torch.empty(src.shape, dtype=src.dtype, device=to,
                              pin_memory=to.type == "cpu")
            dst.copy_(src, non_blocking=True)
        if rec_stream:  # a device source: not reused before the side stream has read it
            src.record_stream(self.side)
        return dst

    def _retire(self, keep: int) -> None:
        """Copies down of all but the newest `keep` pending blocks: waited for, their
        device bytes no longer held. On CUDA the host waits for the event: the caching
        allocator hands a freed block with pending side-stream use to no one until that
        use is over, so a host running ahead of the GPU would allocate every block's
        activations anew and the window would not bound memory (FSDP's rate limiter,
        limit_all_gathers, waits on the host for the same reason). It waits only when the
        copies lag two blocks behind the compute."""
        while len(self._pending) > keep:
            rec = self._pending.popleft()
            if rec.down is not None:
                rec.down.synchronize()
            self._account(device=-rec.bytes)

    # backward -----------------------------------------------------------------------------

    def _on_grad(self, ref: weakref.ref, grad: torch.Tensor) -> None:
        """Block `ref`'s backward is about to start: drop the block after it, make it
        ready, start the reload of the block before it."""
        rec = ref()
        if rec is None:
            return
        self._retire(keep=0)
        after = rec.next() if rec.next is not None else None
        if after is not None:
            self._release(after)
        self._load(rec)
        if rec.prev is not None:
            self._load(rec.prev)

    def _load(self, rec: _Block) -> None:
        if rec.device is not None:
            return
        self._log("reload", rec)
        rec.device = {k: self._copy(h, self.device, rec_stream=False)
                      for k, h in rec.host.items()}
        if self.cuda:
            rec.up = self.side.record_event()
        self.reloaded_bytes += rec.bytes
        self._account(device=rec.bytes)

    def _release(self, rec: _Block) -> None:
        if rec.device is not None:
            self._log("release", rec)
            rec.device, rec.up = None, None
            self._account(device=-rec.bytes)

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        rec = h.block
        if rec.device is None:  # no prefetch reached it (W after B, or a stray order)
            self._load(rec)
        if not rec.unpacked:
            rec.unpacked = True
            self._log("unpack", rec)
        buf = rec.device[h.key]
        if self.cuda:  # reloaded on the side stream, used on the compute stream
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(rec.up)
            buf.record_stream(stream)
        return torch.empty(0, dtype=h.dtype, device=buf.device).set_(
            buf.untyped_storage(), h.offset, h.size, h.stride)

    def _account(self, host: int = 0, device: int = 0) -> None:
        self.host_bytes += host
        self.device_bytes += device
        self.host_peak = max(self.host_peak, self.host_bytes)
        self.device_peak = max(self.device_peak, self.device_bytes)

    def _log(self, what: str, rec: _Block) -> None:
        if self.trace is not None:
            self.trace.append((what, rec.chain, rec.index))
