"""Will a rank's share fit? The planner's per-rank memory against the device, before building.

A layout that cannot fit should fail in a second with the planner's figure, not after
minutes of building with an out-of-memory kill (which on a CPU machine may take the
user's other processes with it). The planner's estimate (plan/memory.py: model states,
activations, buffers) is compared with what each rank can have: a GPU's memory, or on CPU
the machine's memory shared by the ranks started on it. Host memory holds a save's staging
pool too (plan/checkpoint_io.py, `checkpoint.staging_mb`): on CPU it adds to the rank's
figure; on a GPU the host's share (that pool, pinned, and what offload keeps in host
memory) is checked against the machine's memory over its ranks. `train.memory_check = false`
skips it (the estimate is an estimate: docs/planner.md says how close it comes).
"""

from __future__ import annotations

import os

import torch

from shardtrain.config import Config, ConfigError
from shardtrain.cost.hardware import gpu_preset
from shardtrain.plan.checkpoint_io import checkpoint_staging_bytes
from shardtrain.plan.layout import PlanError, config_layout
from shardtrain.plan.memory import memory_per_gpu

TERMS = ("params", "grads", "optimizer", "master", "activations", "buffers")


def rank_capacity(device_kind: str, local_ranks: int) -> tuple[int, str]:
    """(bytes one rank can have, what they are): the smallest visible GPU's usable memory,
    or the machine's physical memory over the ranks started on it."""
    if device_kind == "cuda":
        # Not the whole card: the CUDA context (about 0.5 GiB), NCCL's buffers (NCCL_BUFFSIZE,
        # 4 MiB, per channel and peer of each of the rank's communicators: up to a few hundred
        # MiB each) and the caching allocator's fragmentation take the rest. The planner's own
        # rule (cost/hardware.py `usable_fraction`, 90% of every GPU preset), so a layout the
        # search says fits passes here and one it rejects is refused.
        usable = min(gpu_preset(torch.cuda.get_device_name(i)).usable_fraction
                     * torch.cuda.get_device_properties(i).total_memory
                     for i in range(torch.cuda.device_count()))
        return int(usable), ("the GPU's usable memory (the rest: the CUDA context, NCCL's "
                             "buffers, fragmentation)")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if local_ranks == 1:
        return total, "this machine's memory"
    return total // local_ranks, f"this machine's memory over its {local_ranks} ranks"


def check_fits(cfg: Config, world_size: int, *, device_kind: str, local_ranks: int) -> None:
    """ConfigError (exit 2) when the planned per-rank memory exceeds the rank's capacity,
    naming the figure, the largest terms and the fixes. Layouts the planner does not
    describe are not checked."""
    if not cfg.train.memory_check:
        return
    try:
        staging = cfg.checkpoint.staging_mb * 2**20
        estimate = memory_per_gpu(cfg.model, config_layout(cfg, world_size, device_kind),
                                  seq_len=cfg.train.seq_len,
                                  bucket_bytes=cfg.comm.bucket_mb * 2**20,
                                  node_size=cfg.parallel.node_size or local_ranks,
                                  staging_bytes=staging)
    except PlanError:
        return
    pool = checkpoint_staging_bytes(estimate, staging)
    if device_kind == "cuda":
        _check_host(estimate.host, pool, local_ranks)
    capacity, what = rank_capacity(device_kind, local_ranks)
    terms = {t: getattr(estimate, t) for t in TERMS}
    if device_kind != "cuda":  # the host is the device
        terms["checkpoint staging"] = pool
    if sum(terms.values()) <= capacity:
        return
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{name} {gib(v)}" for name, v in top)
    fix = "lower checkpoint.staging_mb, " if "checkpoint staging" in dict(top) else ""
    raise ConfigError(
        f"the planner puts each rank at {gib(sum(terms.values()))} ({largest}), more than "
        f"{what} ({gib(capacity)}); {fix}shard further (parallel.zero 3, more ranks, parallel.tp "
        "or parallel.pp), shorten train.seq_len or train.micro_batch, or set "
        "train.memory_check false to try anyway")


def _check_host(host: float, pool: float, local_ranks: int) -> None:
    """ConfigError when a rank's host memory (offloaded state, a save's staging pool)
    exceeds the machine's memory over its ranks."""
    capacity, what = rank_capacity("cpu", local_ranks)
    if host > capacity:
        raise ConfigError(
            f"the planner puts each rank's host memory at {gib(host)} (a save's staging pool "
            f"{gib(pool)}), more than {what} ({gib(capacity)}); lower "
            "checkpoint.staging_mb, offload less (parallel.offload) or use more nodes")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
