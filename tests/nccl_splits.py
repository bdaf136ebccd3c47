"""torch.distributed's group creation under NCCL with the device bound at init_process_group
(launch.py), simulated rank by rank on a CPU: which `new_group` calls make a rank join a
split of the world's NCCL communicator. ncclCommSplit is collective over every rank of the
world and pairs the k-th call of each rank with the k-th of every other: a rank that makes
fewer splits leaves the others waiting forever, and the ranks that give a colour at call k
must be exactly that group's.

The model, read from torch 2.13's distributed_c10d.py (these lines predate 2.7, so the GPU
machines' 2.11 has them too):
- `_new_group_with_tag`: with use_local_synchronization, a non-member returns before
  anything else (no split);
- `_new_process_group_helper`, the default group having a bound device (so `split_from` is
  its NCCL backend): a non-member calls `perform_nocolor_split`, one split without colour,
  whatever the new group's backend;
- a member builds a backend per device of the new group's backend string ("nccl" is
  {cuda: nccl}, "gloo" {cpu: gloo, cuda: gloo}, "cpu:gloo,cuda:nccl" both); the NCCL one is
  made with `split_from` and connected at once (`eager_connect_single_device`): one split
  with the group's colour. Gloo's eager connect does nothing: a Gloo-only group costs its
  members no split.

`splits(world, build)` runs `build(rank)` (the runtime's own group-creating code) for each
rank with torch.distributed's group functions replaced by this model and returns each
rank's calls in order: the group's ranks (a colour) or None (no colour). `problems` says
what would hang.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

import torch.distributed as dist

Call = tuple[int, ...] | None  # the new group's ranks (its colour), or None: no colour


class _Group:
    def __init__(self, ranks: list[int], backend: str):
        self.ranks, self.backend = ranks, backend


def _devices(backend: str) -> dict[str, str]:
    if ":" in backend:
        return dict(pair.split(":") for pair in backend.split(","))
    return {"nccl": {"cuda": "nccl"}, "gloo": {"cpu": "gloo", "cuda": "gloo"}}[backend]


def _rank_calls(rank: int, world: int, build: Callable[[int], object]) -> list[Call]:
    calls: list[Call] = []

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
                  use_local_synchronization=False, group_desc=None, device_id=None,
                  sort_ranks=True):
        ranks = sorted(ranks) if ranks is not None else list(range(world))
        backend = str(backend or "nccl")
        if rank not in ranks:
            if not use_local_synchronization:
                calls.append(None)  # perform_nocolor_split
            return dist.GroupMember.NON_GROUP_MEMBER
        if _devices(backend).get("cuda") == "nccl":
            calls.append(tuple(ranks))  # split_from + eager_connect_single_device
        return _Group(ranks, backend)

    def get_backend(group=None):
        return "nccl" if group is None or group is dist.group.WORLD else group.backend

    fake = dict(new_group=new_group, get_backend=get_backend, is_initialized=lambda: True,
                get_rank=lambda group=None: rank, get_world_size=lambda group=None: world)
    with ExitStack() as stack:
        for name, value in fake.items():
            stack.enter_context(mock.patch.object(dist, name, value))
        build(rank)
    return calls


def splits(world: int, build: Callable[[int], object]) -> list[list[Call]]:
    """Each rank's NCCL comm splits, in order, as `build(rank)` makes them."""
    return [_rank_calls(rank, world, build) for rank in range(world)]


def problems(calls: list[list[Call]]) -> list[str]:
    """What would hang or build a wrong communicator; empty when every rank agrees."""
    counts = [len(c) for c in calls]
    if len(set(counts)) > 1:
        return [f"ranks make different numbers of world splits: {counts} (rank: count "
                f"{dict(enumerate(counts))}); the ranks with fewer leave the others waiting"]
    found = []
    for k in range(counts[0] if counts else 0):
        colours: dict[tuple[int, ...], list[int]] = {}
        for rank, rank_calls in enumerate(calls):
            if rank_calls[k] is not None:
                colours.setdefault(rank_calls[k], []).append(rank)
        found += [f"split {k}: group {list(group)} joined by ranks {ranks}"
                  for group, ranks in colours.items() if list(group) != ranks]
    return found
