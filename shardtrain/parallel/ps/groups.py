"""The communicators of a parameter-server run: the world (every push and pull travels
point-to-point in it), the workers' group (their data-parallel group: sampler shards, eval
and loss metrics) and the servers' group (the global gradient norm for clipping)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator


@dataclass
class PSGroups:
    world: Communicator
    workers: Communicator
    servers: Communicator
    is_server: bool
    index: int  # worker index, or server index


def build_groups(rank: int, world_size: int, servers: int, ledger: CommLedger, *,
                 timeout_s: float = 300.0) -> PSGroups:
    """Every rank calls this (torch.distributed creates groups collectively)."""
    n = world_size - servers
    ranks = list(range(world_size))
    roles = {"workers": ranks[:n], "servers": ranks[n:]}
    comms = {}
    for name, members in roles.items():
        group = dist.new_group(members) if len(members) > 1 else None
        if rank in members:
            comms[name] = Communicator(group, name=f"ps_{name}", ranks=members, ledger=ledger,
                                       timeout_s=timeout_s)
    world = Communicator(dist.group.WORLD if world_size > 1 else None, name="ps",
                         ranks=ranks, ledger=ledger, timeout_s=timeout_s)
    is_server = rank >= n
    solo = Communicator(None, name="ps_solo", ranks=[rank], ledger=ledger)
    return PSGroups(world=world, workers=comms.get("workers", solo),
                    servers=comms.get("servers", solo), is_server=is_server,
                    index=rank - n if is_server else rank)
