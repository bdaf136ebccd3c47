"""The communicators a parameter-server run adds to the mesh's: the world (every push and
pull travels point-to-point in it) and the servers' group (the global gradient norm for
clipping). The workers' group is the mesh's dp group (sampler shards, eval and metrics).

Their tensors live in host memory and travel over Gloo whatever the run's backend: a
server takes whichever worker's push comes first, a receive from any source that NCCL does
not offer, and servers are host processes (Li et al. 2014's servers are CPU machines).
On a CPU run they are the default Gloo groups; on GPUs, a deliberate CPU side channel."""

from __future__ import annotations

import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator
from shardtrain.mesh import CUDA_BACKEND


def ps_comms(rank: int, world_size: int, servers: int, ledger: CommLedger, *,
             timeout_s: float = 300.0) -> tuple[Communicator, Communicator]:
    """(world, servers' group) -- every rank calls this, after building its mesh, as
    torch.distributed creates groups collectively. Ranks world_size - servers .. are servers;
    a worker's servers' communicator is a group of itself."""
    first = world_size - servers
    members = list(range(first, world_size))
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    # Under NCCL the servers' group has an NCCL backend beside its Gloo one, never used: with
    # the device bound (launch.py) a new group costs each non-member a split of the world's
    # NCCL communicator, and a Gloo-only one costs its members none, so the workers would
    # make one split more than the servers and every rank wait forever (mesh.py's module
    # doc; tests/test_nccl_splits.py). Its CPU tensors travel over Gloo.
    group = None
    if servers > 1:
        group = dist.new_group(members, backend="gloo" if gloo else CUDA_BACKEND)
    if rank in members:
        mine = Communicator(group, name="ps_servers", ranks=members, ledger=ledger,
                            timeout_s=timeout_s)
    else:
        mine = Communicator(None, name="ps_servers", ranks=[rank], ledger=ledger)
    everyone = None
    if world_size > 1:  # every rank a member: no split of the NCCL communicator
        everyone = dist.group.WORLD if gloo else dist.new_group(list(range(world_size)),
                                                                  backend="gloo")
    world = Communicator(everyone, name="ps",
                         ranks=list(range(world_size)), ledger=ledger, timeout_s=timeout_s)
    return world, mine
