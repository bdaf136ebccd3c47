"""The communicators a parameter-server run adds to the mesh's: the world (every push and
pull travels point-to-point in it) and the servers' group (the global gradient norm for
clipping). The workers' group is the mesh's dp group (sampler shards, eval and metrics).

Both are Gloo groups whatever the run's backend, and their tensors live in host memory: a
server takes whichever worker's push comes first, a receive from any source that NCCL does
not offer, and servers are host processes (Li et al. 2014's servers are CPU machines).
On a CPU run they are the default Gloo groups; on GPUs, a deliberate CPU side channel."""

from __future__ import annotations

import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator


def ps_comms(rank: int, world_size: int, servers: int, ledger: CommLedger, *,
             timeout_s: float = 300.0) -> tuple[Communicator, Communicator]:
    """(world, servers' group) -- every rank calls this, after building its mesh, as
    torch.distributed creates groups collectively. Ranks world_size - servers .. are servers;
    a worker's servers' communicator is a group of itself."""
    first = world_size - servers
    members = list(range(first, world_size))
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    group = dist.new_group(members, backend="gloo") if servers > 1 else None
    if rank in members:
        mine = Communicator(group, name="ps_servers", ranks=members, ledger=ledger,
                            timeout_s=timeout_s)
    else:
        mine = Communicator(None, name="ps_servers", ranks=[rank], ledger=ledger)
    everyone = None
    if world_size > 1:
        everyone = dist.group.WORLD if gloo else dist.new_group(list(range(world_size)),
                                                                  backend="gloo")
    world = Communicator(everyone, name="ps",
                         ranks=list(range(world_size)), ledger=ledger, timeout_s=timeout_s)
    return world, mine
