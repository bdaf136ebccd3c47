"""Host memory a checkpoint save holds: the staging pool (ckpt/stream.py).

A rank stages the chunks it writes through reused host buffers of `checkpoint.staging_mb`
(pinned on a GPU), or fewer where its whole share is smaller (ckpt/dcp.py `start`: the
pool is min(staging, share)). Under `parallel.offload = nvme` the offloaded optimizer
state goes from its memory-mapped files straight into those buffers (zero/offload.py
`shard_state`): the mapped pages are the kernel's clean page cache, reclaimable, so the
stream adds no buffer of its own beyond the pool. The share is bounded above by every
state the rank holds (its parameters, master, moments and offloaded state): the figure
matters only where the share is smaller than the pool, a small model.
"""

from __future__ import annotations

from typing import Protocol

from shardtrain.config.schema import CheckpointConfig

DEFAULT_STAGING_BYTES = CheckpointConfig().staging_mb * 2**20


class _States(Protocol):  # plan/memory.py's ModelStates and MemoryBreakdown both
    params: float
    master: float
    optimizer: float
    offloaded: float


def checkpoint_staging_bytes(states: _States, staging_bytes: float | None = None) -> float:
    """Host bytes of a save's staging pool: `staging_bytes` (None: checkpoint.staging_mb's
    default), or the rank's share where smaller (module docstring)."""
    staging = DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
    share = states.params + states.master + states.optimizer + states.offloaded
    return min(staging, share)
