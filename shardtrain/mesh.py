"""ParallelMesh: the one validated topology object that owns every process group.

Ranks are laid out over the dims (rep, pp, dp, cp, tp), tp innermost so a tensor-parallel
group is a run of consecutive ranks (and so sits inside a node), the replica groups
(parallel.replicas, parallel/replica/) outermost, so each group is a contiguous block of
ranks, as it is its own torchrun world under fault.mode=replicas:

    rank = rep_i * (world / rep) + ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Every other dim stays inside a group: dp here is a group's data-parallel degree
(parallel.dp / replicas), so ZeRO shards over it and the groups replicate (HSDP). `rep`
groups the ranks with the same coordinates in every other dim, one per group.

Expert parallelism is carved out of the flattened (dp, cp) index j = dp_i * cp + cp_i:
ep_i = j % ep groups consecutive j's, and edp_i = j // ep indexes the replicas of each
expert shard (the group that averages expert gradients).

Nodes are runs of `node_size` consecutive global ranks: the launcher's LOCAL_WORLD_SIZE,
or a configured virtual node size so hierarchical algorithms can be tested on one machine.

The mesh owns the topology and creates every process group (this is the one place that
calls `new_group`); it imports nothing of shardtrain.comm. A `Group` says all a
communicator needs to know about one group, and the `communicator` the mesh is given
(shardtrain.comm.CommFactory, or `shardtrain.comm.build_mesh` for both at once) turns each
dim's Group into its Communicator.

Devices: a group's payload lives on the mesh's device. On CUDA each group is one
`cpu:gloo,cuda:nccl` process group (torchtitan's): CUDA payload goes to its NCCL backend,
the small CPU tensors of metadata (size agreement, the link figures, ...) to its Gloo
backend, on purpose, so no NCCL call ever sees a CPU tensor (`meta` is the group itself).

Why one group with two backends, not an NCCL group and a Gloo group beside it: with the
device bound at init_process_group (launch.py), torch creates each new NCCL communicator by
splitting the world's (ncclCommSplit, collective over every rank of the world): a member
splits with the group's colour, every other rank joins with no colour, whatever the new
group's backend. A Gloo-only group costs its non-members a split and its members none, so
a rank outside every group (a parameter server) made two splits per group against the
workers' one and every rank waited forever. Here every group costs every rank exactly one
split, member or not; tests/test_nccl_splits.py counts them per rank for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardtrain.config import ConfigError
from shardtrain.cost.hardware import runtime_link
from shardtrain.cost.link import Link

DIMS = ("pp", "dp", "cp", "tp")
# A mesh group's backends on CUDA: payload over NCCL, CPU metadata over Gloo (module doc).
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    rep: int = 1  # replica groups (outermost; parallel/replica/)
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.rep * self.group_size

    @property
    def group_size(self) -> int:
        """Ranks of one replica group."""
        return self.pp * self.dp * self.cp * self.tp

    def validate(self, world_size: int, node_size: int) -> None:
        for name in ("rep", *DIMS, "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.world_size != world_size:
            raise ConfigError(
                f"replicas={self.rep} x pp={self.pp} x dp={self.dp} x cp={self.cp} x tp={self.tp} "
                f"= {self.world_size} "
                f"does not equal the world size {world_size}; adjust the degrees or --nproc")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp x cp = {self.dp * self.cp}")
        if node_size < 1 or world_size % node_size:
            raise ConfigError(f"node size {node_size} must be >= 1 and divide the world size "
                              f"{world_size} (parallel.node_size)")

    def coords(self, rank: int) -> dict[str, int]:
        """rank -> {rep, pp, dp, cp, tp, ep, edp} coordinates."""
        rep, rank = divmod(rank, self.group_size)
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        edp, ep = divmod(dp * self.cp + cp, self.ep)
        return {"rep": rep, "pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "edp": edp}

    def rank_of(self, *, rep: int = 0, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0
                ) -> int:
        return rep * self.group_size + ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim` as sorted global ranks; the groups of a dim partition the
        world. A group is the set of ranks that agree on the coordinates in _FIXED[dim]."""
        if dim not in _FIXED:
            raise ValueError(f"unknown mesh dim {dim!r}; one of {', '.join(_FIXED)}")
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            buckets.setdefault(tuple(c[k] for k in _FIXED[dim]), []).append(r)
        return list(buckets.values())


def shape_for(cfg: Any, world_size: int) -> MeshShape:
    """The one place that decides this process's mesh from the config and the world it
    sees: under fault.mode=restart one world holds every replica group (rep = replicas);
    under fault.mode=replicas each group is its own world (rep = 1, torchft joins them).
    Either way a group's dp is parallel.dp / replicas."""
    from shardtrain.config.replicas import total_world

    p = cfg.parallel
    dp = p.resolved_dp(total_world(cfg, world_size))
    rep = p.replicas if cfg.fault.mode == "restart" else 1
    return MeshShape(rep=rep, pp=p.pp, dp=dp // p.replicas, cp=p.cp, tp=p.tp, ep=p.ep)


# For each group kind, the coordinates its members share. dp_cp is the flattened data
# dims (gradient averaging when cp > 1); ep/edp split dp_cp for experts. Every group but
# rep's lies inside one replica group; rep's members agree on everything else.
_FIXED: dict[str, tuple[str, ...]] = {
    "pp": ("rep", "dp", "cp", "tp"),
    "dp": ("rep", "pp", "cp", "tp"),
    "cp": ("rep", "pp", "dp", "tp"),
    "tp": ("rep", "pp", "dp", "cp"),
    "dp_cp": ("rep", "pp", "tp"),
    "ep": ("rep", "pp", "tp", "edp"),
    "edp": ("rep", "pp", "tp", "ep"),
    "rep": ("pp", "dp", "cp", "tp"),
}


@dataclass(frozen=True, eq=False)
class Group:
    """One process group of this rank: what a communicator is built from."""

    name: str  # the dim (or sub-group) it serves: dp, tp, dp_node, ...
    ranks: list[int]  # its global ranks, ascending
    handle: dist.ProcessGroup | None  # None: a group of one rank
    meta: dist.ProcessGroup | None  # where CPU metadata goes: handle itself (its Gloo backend)
    device: torch.device  # where its payload lives
    node_size: int  # ranks per node (runs of consecutive global ranks)
    link: Link  # what `auto` and the hierarchical phases price with


class ParallelMesh:
    """Rank <-> coordinates, one process group (and Communicator) per dim, node topology;
    built once, passed down.

    With world size 1 (or a dim of size 1) the groups have no process group and every
    collective is a no-op, so the same code path runs on one process.
    """

    def __init__(self, shape: MeshShape, *, communicator: Callable[[Group], Any], rank: int = 0,
                 node_size: int = 0, timeout_s: float = 300.0,
                 device: torch.device | None = None, link: Link | None = None):
        """`communicator`: builds a Communicator from a Group and holds the ledger they all
        record in (shardtrain.comm.CommFactory); `device`: where payload lives (None: the
        current CUDA device under NCCL, else the CPU); `link`: what `auto` prices with
        (None: cost.hardware.runtime_link for the device, per group)."""
        node_size = node_size or shape.world_size
        shape.validate(shape.world_size, node_size)
        self.shape, self.rank, self.node_size = shape, rank, node_size
        # A rank beyond the mesh (a parameter server beside the workers, parallel/ps/)
        # creates the same groups, as every process must, and holds no communicator.
        self.member = rank < shape.world_size
        self.coords = shape.coords(rank) if self.member else {}
        self.timeout_s, self._link, self._factory = timeout_s, link, communicator
        if shape.world_size > 1 and not dist.is_initialized():
            raise RuntimeError("ParallelMesh with world size > 1 needs torch.distributed "
                               "initialised first (shardtrain.launch.init_distributed)")
        if device is None:
            cuda = shape.world_size > 1 and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else \
                torch.device("cpu")
        self.device = torch.device(device)
        groups = {dim: self.sub_group(dim, lambda r: 0, dim)
                  for dim in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "rep")}
        self._comms = {dim: communicator(g) for dim, g in groups.items() if g is not None}

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def ledger(self):
        """The communication ledger every communicator of this mesh records in."""
        return self._factory.ledger

    def comm(self, dim: str):
        return self._comms[dim]

    @property
    def replica_dim(self) -> str:
        """The group whose ranks hold the same parameters and see different tokens:
        gradients are averaged and ZeRO shards over it, losses averaged. dp, or dp x cp
        under context parallelism (each cp rank's gradient covers its slice of the
        sequences: Liu et al. 2023)."""
        return "dp_cp" if self.shape.cp > 1 else "dp"

    def communicator(self, group: Group):
        """A Communicator for a group made by `sub_group`, with the mesh's settings."""
        return self._factory(group)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def sub_group(self, dim: str, part: Callable[[int], int], name: str) -> Group | None:
        """This rank's part of its `dim` group, every `dim` group being split by `part`
        (global rank -> key; ranks with equal keys share a part). Collective: every rank
        calls it at the same point and creates every part in the same order, which is
        torch.distributed's rule for `new_group`."""
        parts = []
        for ranks in self.shape.groups(dim):
            keyed: dict[int, list[int]] = {}
            for r in ranks:
                keyed.setdefault(part(r), []).append(r)
            parts += keyed.values()
        timeout = timedelta(seconds=self.timeout_s)
        # NCCL payload: metadata on the same group's Gloo backend (module doc). Not under the
        # fake backend of a dry run (train/start/dryrun.py): Gloo would wait for N - 1 ranks
        # that never come, and the fake group carries CPU tensors as well (moving nothing).
        side = self.device.type == "cuda" and not (dist.is_initialized()
                                                    and dist.get_backend() == "fake")
        mine = None
        for ranks in parts:
            handle = None
            if len(ranks) > 1:
                # A group of its own even when it spans the world: two dims sharing one
                # process group (dp and ep at ep = dp = world) would share its order of
                # calls, and a call from dp's lane thread could cross the main thread's.
                handle = dist.new_group(ranks, timeout=timeout,
                                        backend=CUDA_BACKEND if side else None)
            if self.rank in ranks:
                mine = (ranks, handle)
        if mine is None:  # not a member of the mesh
            return None
        ranks, handle = mine
        return Group(name=name, ranks=ranks, handle=handle, meta=handle, device=self.device,
                     node_size=self.node_size, link=self._link or self._runtime_link(ranks))

    def node_group(self, dim: str) -> Group:
        """The ranks of this rank's `dim` group that share its node ("<dim>_node"); every
        node must hold the same number of them."""
        sizes = {sum(1 for r in ranks if self.node_of(r) == n)
                 for ranks in self.shape.groups(dim) for n in {self.node_of(r) for r in ranks}}
        if len(sizes) != 1:
            raise ValueError(f"the node-local parts of the {dim} groups differ in size "
                             f"({sorted(sizes)} ranks with nodes of {self.node_size}); set "
                             "parallel.node_size to a multiple of tp")
        return self.sub_group(dim, self.node_of, f"{dim}_node")

    def _runtime_link(self, ranks: list[int]) -> Link:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        across = len({self.node_of(r) for r in ranks}) > 1
        return runtime_link(self.device.type, gpu_name=name, across_nodes=across)

    def __repr__(self) -> str:
        dims = " ".join(f"{d}={getattr(self.shape, d)}" for d in ("rep", *DIMS, "ep"))
        return (f"ParallelMesh({dims}, rank={self.rank}, coords={self.coords}, "
                f"node_size={self.node_size}, device={self.device})")
