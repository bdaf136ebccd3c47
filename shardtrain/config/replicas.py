"""The [fault] section and the replica-group fields of [parallel] (docs/faults.md): how a
run survives a failure (restart: torchrun restarts every process and the job resumes from
its newest checkpoint; replicas: torchft keeps the live replica groups stepping and a
failed group rejoins from a live peer), and what crosses the groups (parallel.sync)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shardtrain.config.errors import ConfigError

# The environment a replica group's processes get from their launcher (launch_replicas.py,
# the cluster recipes, docs/launching.md): the group's index and the lighthouse's address.
REPLICA_ENV, LIGHTHOUSE_ENV = "SHARDTRAIN_REPLICA", "TORCHFT_LIGHTHOUSE"


@dataclass(kw_only=True)
class FaultConfig:
    """fault.mode = restart (today's: the whole job restarts and resumes from disk) or
    replicas (per-step fault tolerance over parallel.replicas groups, on torchft)."""

    mode: Literal["restart", "replicas"] = "restart"
    # replicas: the torchft lighthouse's address, "http://HOST:PORT"; "" lets
    # `shardtrain train --nproc N` start one beside the groups on this machine.
    lighthouse: str = ""
    # replicas: a step proceeds once this many groups are in its quorum.
    min_replicas: int = 1
    # replicas: how long a quorum (and a rejoining group's state transfer) may take.
    quorum_timeout_s: float = 60.0
    # replicas: the host name or IPv4 address the other groups reach this group's torchft
    # servers at (its manager, its checkpoint transfer, its store): this node's own, given
    # per node. "" advertises this host's name, right wherever that name resolves to an
    # address the other nodes reach (one machine; a cluster's DNS), wrong where it does not
    # (network namespaces sharing one hostname: examples/two_nodes.sh --replicas).
    advertise: str = ""


def total_world(cfg: Any, world_size: int) -> int:
    """Processes over every replica group: under fault.mode=replicas a process sees its own
    group's world (each group is one torchrun), under restart the whole job's."""
    return world_size * cfg.parallel.replicas if cfg.fault.mode == "replicas" else world_size


def data_parallel(cfg: Any, group_dp: int) -> int:
    """The data-parallel degree over every group (what splits train.global_batch), from a
    group's own (the mesh's dp)."""
    return group_dp * cfg.parallel.replicas


def check_replicas(cfg: Any, world_size: int) -> None:
    """parallel.replicas divides dp, the sync fields name a mode that uses them, and
    fault.mode=replicas has groups to fail over between; `world_size` counts every group's
    processes."""
    p, f = cfg.parallel, cfg.fault
    dp = p.resolved_dp(world_size)
    if p.replicas < 1 or dp % p.replicas:
        raise ConfigError(f"parallel.replicas={p.replicas} must be >= 1 and divide dp={dp} "
                          f"(each group holds dp / replicas data-parallel ranks); choose a "
                          f"divisor of {dp} or change the number of processes")
    if p.replicas > 1 and p.ps_servers:
        raise ConfigError(f"parallel.replicas={p.replicas} splits data parallelism into groups, "
                          f"but parallel.ps_servers={p.ps_servers} replaces it with a parameter "
                          "server: set parallel.replicas=1 or parallel.ps_servers=0")
    for name, value, fix in (("comm.compress", "topk" if cfg.comm.compress == "topk" else "",
                              "none or int8"),
                             ("data.streaming", cfg.data.streaming, "false")):
        if p.replicas > 1 and value:  # top-k's state is per rank; a stream has no cursor
            raise ConfigError(f"{name}={value} with parallel.replicas={p.replicas}: the "
                              "replica groups need the update halves of dp and ZeRO and the "
                              "cached sampler (a group's share of a step is by its cursor); "
                              f"set {name}={fix} or parallel.replicas=1")
    if f.mode == "replicas" and p.replicas < 2:
        raise ConfigError("fault.mode=replicas keeps the live replica groups stepping when one "
                          f"fails, and parallel.replicas={p.replicas} gives one group: set "
                          "parallel.replicas >= 2 (dividing dp) or fault.mode=restart")
    if p.sync != "every_step" and p.replicas < 2:
        raise ConfigError(f"parallel.sync={p.sync} averages across replica groups, and "
                          f"parallel.replicas={p.replicas} gives one: set parallel.replicas "
                          ">= 2 or parallel.sync=every_step")
    if p.sync_every < 1 or p.sync_fragments < 1 or p.sync_every % p.sync_fragments:
        raise ConfigError(f"parallel.sync_every={p.sync_every} and parallel.sync_fragments="
                          f"{p.sync_fragments} must be >= 1, the fragments dividing sync_every "
                          "(one fragment synchronised every sync_every / sync_fragments steps)")
    if p.sync == "every_step" and (p.sync_every != 1 or p.sync_fragments != 1):
        raise ConfigError(f"parallel.sync_every={p.sync_every} / sync_fragments="
                          f"{p.sync_fragments} apply to parallel.sync=local_sgd or diloco; "
                          "every_step averages the gradients of every step: drop them")
    if not (p.outer_lr > 0 and 0 <= p.outer_momentum < 1):
        raise ConfigError(f"parallel.outer_lr={p.outer_lr:g} must be > 0 and "
                          f"parallel.outer_momentum={p.outer_momentum:g} lie in [0, 1)")
    if p.sync != "diloco" and (p.outer_lr != 0.7 or p.outer_momentum != 0.9):
        raise ConfigError(f"parallel.outer_lr / outer_momentum set DiLoCo's outer optimizer, "
                          f"and parallel.sync={p.sync}: set parallel.sync=diloco or drop them")
    if f.min_replicas < 1 or f.min_replicas > p.replicas or not f.quorum_timeout_s > 0:
        raise ConfigError(f"fault.min_replicas={f.min_replicas} must lie in 1..parallel."
                          f"replicas={p.replicas} and fault.quorum_timeout_s="
                          f"{f.quorum_timeout_s:g} be > 0")
    for name, value in (("lighthouse", f.lighthouse), ("advertise", f.advertise)):
        if f.mode == "restart" and value:
            raise ConfigError(f"fault.{name}={value!r} applies to torchft's replica groups "
                              "(fault.mode=replicas): set fault.mode=replicas or drop it")
    if f.advertise and any(c in f.advertise for c in "/: \t"):
        # torchft writes its servers' addresses as http://HOST:PORT, unbracketed: no IPv6.
        raise ConfigError(f"fault.advertise={f.advertise!r} must be a bare host name or IPv4 "
                          "address (no scheme, port or path; for IPv6, a host name that "
                          "resolves to it), e.g. 10.0.0.2 or node7")
