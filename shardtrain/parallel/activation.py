"""Activation recomputation, and a meter of what autograd keeps for backward.

- Full (Chen et al. 2016): `checkpoint_blocks` makes each transformer block keep only its
  input during forward and recompute everything else in backward.
- Selective (Korthikanti et al. 2022, section 5): `checkpoint_attention_cores` recomputes
  only the attention core (QK^T, softmax, weights over V), whose saved state grows with
  s^2 when a kernel stores the probabilities, and keeps every linear's inputs.
- `SavedActivations` counts the bytes autograd saves for backward during a forward
  (torch.autograd.graph.saved_tensors_hooks), deduplicated by storage, parameters and
  buffers left out: the runtime side of the planner's activation figures (plan/memory.py,
  docs/recompute.md). `WeightFilter` is its rule for what is a weight, not an
  activation, which activation offload (offload_activations.py) follows too.

Both recomputations replace callables on the instances (`block.forward`, `attn.core`)
rather than wrapping modules, so parameter names and checkpoints are the same either way.
torch.utils.checkpoint's non-reentrant mode is used: the region's saved tensors are not
held, only its inputs, and the region reruns on the first unpack in backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def checkpoint_attention_cores(blocks: nn.ModuleList) -> int:
    """Wrap each block's `attn.core` (whatever callable it holds now) in a non-reentrant
    checkpoint: q, k, v [B, H|G, S, D] are kept, the core's own saved state (the S x S
    probabilities of the math kernel; out + logsumexp of flash-style kernels) is rebuilt
    in backward. Returns the number of cores wrapped.

    Cores that declare `recomputes_in_backward = True` (a core that manages its own
    backward memory) are left alone: ring attention's autograd Function already saves only
    q, k, v, out and the logsumexp and rebuilds every block in backward, so wrapping it
    would save nothing and replay the ring's sends; a Ulysses core would replay its two
    all-to-alls to drop at most SDPA's logsumexp. Call this after context parallelism has
    installed its core, so the flag is seen (called before, it would wrap the SDPA core
    that context parallelism then replaces, and the checkpoint would be lost)."""
    wrapped = 0
    for block in blocks:
        core = block.attn.core
        if getattr(core, "recomputes_in_backward", False) or getattr(core, "checkpointed", False):
            continue
        block.attn.core = _CheckpointedCore(core)
        wrapped += 1
    return wrapped


class _CheckpointedCore:
    """`core` run under a non-reentrant checkpoint; keeps the attribute so wrapping twice
    is a no-op."""

    checkpointed = True

    def __init__(self, core: Any):
        self.core = core

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *mask: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.core, q, k, v, *mask, use_reentrant=False)


class WeightFilter:
    """What of a saved tensor is not an activation (the one rule for the meter below and
    for activation offload): a parameter or buffer of `module` or one of `extra`
    tensors, a view of one (by storage, or by its base where a storage was swapped since),
    or autocast's low-precision copy of a parameter (a cast whose grad_fn leads straight to
    the parameter: weights, cached once per forward). Storages are read when built: build
    it while the weights hold theirs (ZeRO-3 gathers a block's weights before its forward)."""

    def __init__(self, module: nn.Module | None = None, extra: list[torch.Tensor] = ()):
        tensors = list(module.parameters()) + list(module.buffers()) if module is not None \
            else []
        self.storages = {t.untyped_storage().data_ptr() for t in tensors + list(extra)
                         if t.numel()}
        self.ids = {id(t) for t in tensors}

    def __call__(self, t: torch.Tensor) -> bool:
        base = t if t._base is None else t._base
        if t.untyped_storage().data_ptr() in self.storages or id(base) in self.ids:
            return True
        fn = t.grad_fn
        while fn is not None and type(fn).__name__.startswith(("ToCopyBackward", "TBackward",
                                                               "TransposeBackward")):
            fn = fn.next_functions[0][0] if fn.next_functions else None
            if fn is not None and type(fn).__name__ == "AccumulateGrad":
                return id(fn.variable) in self.ids
        return False


class SavedActivations:
    """Context manager: the bytes autograd saves for backward inside it.

    Each saved tensor is keyed by its storage (a tensor saved by two ops, or two views of
    one storage, count once: the storage's full size). Left out: what `WeightFilter` says
    is a weight of `exclude` (a module) or of the `extra` tensors. Under a non-reentrant
    checkpoint the region's own saved tensors are never packed outside the recomputation,
    so they are not counted.

    `bytes` total; `by_dtype` {dtype name: bytes}; `shapes` [(shape, dtype)] of the
    counted storages, in the order first saved (for docs and debugging)."""

    def __init__(self, exclude: nn.Module | None = None, extra: list[torch.Tensor] = ()):
        self._weights = WeightFilter(exclude, extra)
        self._seen: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and t.numel():
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen and not self._weights(t):
                self._seen[key] = (storage.nbytes(), t.dtype, tuple(t.shape))
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(n for n, _, _ in self._seen.values())

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, dtype, _ in self._seen.values():
            name = str(dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + n
        return out

    @property
    def shapes(self) -> list[tuple[tuple[int, ...], str]]:
        return [(shape, str(dtype).removeprefix("torch.")) for _, dtype, shape in
                self._seen.values()]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def saved_bytes_per_block(block: nn.Module, x: torch.Tensor, *args: Any) -> SavedActivations:
    """What one block's forward saves for backward, measured in isolation: `x` [B, S, C]
    is copied into a storage of its own and made to require grad (as the previous block's
    output would be; a view would bring its base's whole storage into the count), the
    block's parameters and buffers and the extra `args` (the RoPE tables: the model's
    buffers) are excluded; x itself is counted when the block saves it (the layer input)."""
    x = x.detach().clone().requires_grad_(True)
    meter = SavedActivations(exclude=block, extra=tensors_of(args))
    with meter:
        block(x, *args)
    return meter


def tensors_of(args: Any) -> list[torch.Tensor]:
    """The tensors in `args` (nested tuples and lists)."""
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in tensors_of(a)]
    return []
