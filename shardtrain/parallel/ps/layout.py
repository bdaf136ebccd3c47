"""Who holds what in a parameter-server run: roles, server shards and partitions.

Roles: world ranks 0 .. N-1 are workers (rank 0 writes metrics, as in every layout), ranks
N .. N+S-1 are servers 0 .. S-1.

Shards are equal byte ranges of the flat parameter vector taken in forward order (embedding
first, head last), not whole parameters: a whole-parameter split cannot balance a model whose
embedding and head are each a large part of it, and the point of several servers is to
divide the incast (every worker's push lands on the servers: N x model bytes per step in
all) evenly, N x model bytes / S each. A range is cut further into partitions of at most
`partition_bytes` that never span two parameters, so each has one weight-decay rule and one
layer; its index in forward order is its priority (ByteScheduler, Peng et al. 2019: the
first layers are needed first by the next forward).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from shardtrain.comm.p2p import even_bounds, message_tag
from shardtrain.config import Config, ConfigError
from shardtrain.cost.counts import param_counts

HEAD = "ps:head"  # a worker's push is complete: [clock, version computed on, grad norm]
PULL = "ps:pull"  # a server's reply of one partition follows: [partition, version]
STATE = "ps:state"  # a server's optimizer state, to the checkpoint writer
INIT = "ps:init"  # the starting weights of a server's shard, from worker 0


@dataclass(frozen=True)
class Part:
    index: int  # position in forward order: the priority (0 first)
    param: int  # index in the model's parameter list
    lo: int  # [lo, hi): elements of the flattened parameter
    hi: int
    server: int
    decay: bool  # weight decay applies (matrices, as train/optim.py groups them)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class PSLayout:
    def __init__(self, params: list[torch.Tensor], *, workers: int, servers: int,
                 partition_bytes: float):
        self.workers, self.servers = workers, servers
        numels = [p.numel() for p in params]
        self.numel = sum(numels)
        self.bounds = even_bounds(self.numel, servers)  # server s: [bounds[s], bounds[s+1])
        cap = max(1, int(partition_bytes) // 4)  # fp32 elements
        parts, offset = [], 0
        for i, (n, p) in enumerate(zip(numels, params)):
            for s in range(servers):
                lo, hi = max(self.bounds[s], offset), min(self.bounds[s + 1], offset + n)
                if lo >= hi:
                    continue
                cuts = even_bounds(hi - lo, math.ceil((hi - lo) / cap))
                for a, b in itertools.pairwise(cuts):
                    parts.append(Part(len(parts), i, lo - offset + a, lo - offset + b, s,
                                      p.dim() >= 2))
            offset += n
        self.parts = parts
        labels = _distinct([f"ps:g{j}" for j in range(len(parts))] +
                           [f"ps:w{j}" for j in range(len(parts))], reserved=(HEAD, PULL, STATE, INIT))
        self.push_tag, self.pull_tag = labels[:len(parts)], labels[len(parts):]

    def server_rank(self, s: int) -> int:
        return self.workers + s

    def on_server(self, s: int) -> list[Part]:
        return [p for p in self.parts if p.server == s]

    def server_bytes(self, s: int) -> int:
        """fp32 bytes server s holds: what it receives from each worker per push."""
        return 4 * (self.bounds[s + 1] - self.bounds[s])


def check_servers(cfg: Config) -> None:
    """Before launch: every server must own at least one parameter (an equal range of the
    flat parameter vector)."""
    total = param_counts(cfg.model).total
    if cfg.parallel.ps_servers > total:
        raise ConfigError(f"parallel.ps_servers={cfg.parallel.ps_servers} outnumbers the "
                          f"model's {total} parameters: servers hold equal ranges of them, each "
                          "at least one; lower parallel.ps_servers")


def _distinct(labels: list[str], reserved: tuple[str, ...]) -> list[str]:
    """Message labels whose wire tags (15 bits of a hash) all differ, so that messages of
    different partitions between two ranks can never match each other's receive: a label
    that collides gets a suffix until it does not. Every rank computes the same labels."""
    used = {message_tag(r) for r in reserved}
    out = []
    for label in labels:
        salt, chosen = 0, label
        while message_tag(chosen) in used:
            salt += 1
            chosen = f"{label}~{salt}"
        used.add(message_tag(chosen))
        out.append(chosen)
    return out
