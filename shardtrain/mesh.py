"""ParallelMesh: the one validated topology object that owns every process group.

Ranks are laid out over the dims (pp, dp, cp, tp), tp innermost so a tensor-parallel
group is a run of consecutive ranks (and so sits inside a node), pp outermost:

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism is carved out of the flattened (dp, cp) index j = dp_i * cp + cp_i:
ep_i = j % ep groups consecutive j's, and edp_i = j // ep indexes the replicas of each
expert shard (the group that averages expert gradients).

Nodes are runs of `node_size` consecutive global ranks: the launcher's LOCAL_WORLD_SIZE,
or a configured virtual node size so hierarchical algorithms can be tested on one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator
from shardtrain.config import ConfigError
from shardtrain.cost.hardware import runtime_link
from shardtrain.cost.link import Link

DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def validate(self, world_size: int, node_size: int) -> None:
        for name in (*DIMS, "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.world_size != world_size:
            raise ConfigError(
                f"pp={self.pp} x dp={self.dp} x cp={self.cp} x tp={self.tp} = {self.world_size} "
                f"does not equal the world size {world_size}; adjust the degrees or --nproc")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp x cp = {self.dp * self.cp}")
        if node_size < 1 or world_size % node_size:
            raise ConfigError(f"node size {node_size} must be >= 1 and divide the world size "
                              f"{world_size} (parallel.node_size)")

    def coords(self, rank: int) -> dict[str, int]:
        """rank -> {pp, dp, cp, tp, ep, edp} coordinates."""
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        edp, ep = divmod(dp * self.cp + cp, self.ep)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "edp": edp}

    def rank_of(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

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


# For each group kind, the coordinates its members share. dp_cp is the flattened data
# dims (gradient averaging when cp > 1); ep/edp split dp_cp for experts.
_FIXED: dict[str, tuple[str, ...]] = {
    "pp": ("dp", "cp", "tp"),
    "dp": ("pp", "cp", "tp"),
    "cp": ("pp", "dp", "tp"),
    "tp": ("pp", "dp", "cp"),
    "dp_cp": ("pp", "tp"),
    "ep": ("pp", "tp", "edp"),
    "edp": ("pp", "tp", "ep"),
}


class ParallelMesh:
    """Rank <-> coordinates, one Communicator per dim, node topology; built once, passed down.

    With world size 1 (or a dim of size 1) the communicators have no process group and
    every collective is a no-op, so the same code path runs on one process.
    """

    def __init__(self, shape: MeshShape, *, rank: int = 0, node_size: int = 0,
                 algorithm: str = "native", timeout_s: float = 300.0, link: Link | None = None):
        """`link`: what `auto` and hierarchical price with (None: cost.hardware.runtime_link
        for this process's device)."""
        node_size = node_size or shape.world_size
        shape.validate(shape.world_size, node_size)
        self.shape, self.rank, self.node_size = shape, rank, node_size
        self.ledger = CommLedger()
        self.coords = shape.coords(rank)
        self._comms: dict[str, Communicator] = {}
        distributed = shape.world_size > 1
        if distributed and not dist.is_initialized():
            raise RuntimeError("ParallelMesh with world size > 1 needs torch.distributed "
                               "initialised first (shardtrain.launch.init_distributed)")
        timeout = timedelta(seconds=timeout_s)
        link = link or runtime_link("cpu")
        # Every rank must create every group, in the same order (torch.distributed rule).
        for dim in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp"):
            mine = None
            for ranks in shape.groups(dim):
                group = None
                if len(ranks) > 1:
                    group = dist.new_group(ranks, timeout=timeout) if len(ranks) < shape.world_size \
                        else dist.group.WORLD
                if rank in ranks:
                    mine = (ranks, group)
            ranks, group = mine
            self._comms[dim] = Communicator(group, name=dim, ranks=ranks, ledger=self.ledger,
                                            node_size=node_size, algorithm=algorithm,
                                            timeout_s=timeout_s, link=link)

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def comm(self, dim: str) -> Communicator:
        return self._comms[dim]

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def __repr__(self) -> str:
        dims = " ".join(f"{d}={getattr(self.shape, d)}" for d in (*DIMS, "ep"))
        return f"ParallelMesh({dims}, rank={self.rank}, coords={self.coords}, node_size={self.node_size})"
