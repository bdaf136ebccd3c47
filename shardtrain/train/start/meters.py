"""What the dry run measures during a step (dryrun.py): the saved activations autograd holds
at once (`LiveSavedActivations`), and the step peak (`StepGrowth`): the most bytes
allocated at once during a step, above what was allocated when it started.

On a GPU that is the CUDA caching allocator's own count (max_memory_allocated). A CPU has
no allocator counter, and the process's resident set (the other CPU figure) also holds the
Python and torch runtime and whatever the allocator keeps cached, so the planner's figure
cannot be read off it. Here the bytes malloc has handed out and not taken back (glibc's
mallinfo2: in-use heap chunks of every arena plus mmapped chunks, whichever thread
allocated them) are sampled after every tensor op, forward and backward (a
TorchDispatchMode, which autograd carries into its backward): the CPU counterpart of
max_memory_allocated, live tensors and buffers without the allocator's free cache. A peak
inside one op (its temporaries) is not seen; its output is.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.parallel.activation import SavedActivations


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2"):  # glibc < 2.33
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


_INFO = _mallinfo2()


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not taken back, over all arenas (glibc >= 2.33;
    None elsewhere)."""
    if _INFO is None:
        return None
    info = _INFO()
    return info.uordblks + info.hblkhd


class PeakAllocated(TorchDispatchMode):
    """The largest malloc_in_use_bytes() seen after any tensor op run inside it."""

    def __init__(self):
        super().__init__()
        self.start = self.peak = malloc_in_use_bytes() or 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_in_use_bytes() or 0)
        return out


class StepGrowth:
    """`with StepGrowth(device) as g: ...` then `g.bytes`: the most bytes allocated at once
    inside the block above those allocated when it began (None where it cannot be
    measured: a CPU without glibc's mallinfo2, or not `enabled`)."""

    def __init__(self, device: torch.device, *, enabled: bool = True):
        self.device, self.bytes, self.enabled = device, None, enabled
        self.earlier_peak = 0  # CUDA: the allocator's peak before the block (it resets it)
        self._mode: PeakAllocated | None = None

    def __enter__(self) -> StepGrowth:
        if not self.enabled:
            pass
        elif self.device.type == "cuda":  # the allocator counts as it allocates: no sync
            self.earlier_peak = torch.cuda.max_memory_allocated(self.device)  # reset below
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif _INFO is not None:
            self._mode = PeakAllocated().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            pass
        elif self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self.bytes = self._mode.peak - self._mode.start


class _Held:
    """A saved tensor while autograd holds it; its release is the graph letting go."""

    def __init__(self, tensor: torch.Tensor, meter: "LiveSavedActivations", key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter.release(self.key)


class LiveSavedActivations(SavedActivations):
    """`peak`: the most bytes autograd held for backward at one moment, counted as
    SavedActivations counts them (each storage once; parameters, `exclude`'s tensors and
    autocast's copies of parameters left out). A storage stays counted while any saved
    tensor of it is alive in the graph, so micro-batches in flight add up and a released
    layer's activations leave: the peak the planner's `activations` predicts."""

    def __init__(self, exclude: torch.nn.Module):
        super().__init__(exclude)
        self._live: dict[int, list[int]] = {}  # storage address -> [saved refs, bytes]
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._hold, lambda x: x.tensor if isinstance(x, _Held) else x)

    def _hold(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta" or not t.numel() or isinstance(t, torch.nn.Parameter):
            return t
        key = t.untyped_storage().data_ptr()
        if self._weights(t):
            return t
        entry = self._live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(t, self, key)

    def release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._live[key]
