"""A parameter server's traffic per step (Li et al. 2014; seed 001's incast).

N workers each push their whole gradient G (partitioned over the S servers) and pull the
whole model P back; server s holds an equal byte range of the flat parameters (the
runtime's shards, parallel/ps/layout.py: the first numel mod S servers hold one element
more), so the busiest server receives N x ceil(numel / S) gradient values per step and
sends as many weights: N x model bytes / S, against 2 (N-1)/N G per rank of a ring
all-reduce. Those bytes cross the server's own link, which is why S servers divide the
time: a push takes alpha + N G / S beta at the server (incast), not at the worker.
Pushes overlap backward (wait-free back-propagation); pulls are exposed except for what
the next forward's priority order hides.
"""

from __future__ import annotations

import math
from typing import Any

from shardtrain.cost.link import Link
from shardtrain.config import ModelConfig
from shardtrain.cost.counts import param_counts
from shardtrain.plan.layout import Layout
from shardtrain.plan.ops import CommOp
from shardtrain.plan.memory import STATE_BYTES


def server_values(cfg: ModelConfig, servers: int) -> int:
    """Parameters the busiest server holds (even byte ranges of the flat vector)."""
    return math.ceil(param_counts(cfg).total / servers)


def ps_summary(cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    """Bytes per step of the busiest server and of one worker, and the ring's, for the
    plan's JSON."""
    n, s = layout.dp, layout.ps_servers
    p_bytes, g_bytes = STATE_BYTES[layout.precision][:2]
    total = param_counts(cfg).total
    return {"servers": s, "workers": n,
            "server_recv_bytes_per_step": n * server_values(cfg, s) * g_bytes,
            "server_sent_bytes_per_step": n * server_values(cfg, s) * p_bytes,
            "worker_sent_bytes_per_step": total * g_bytes,
            "ring_all_reduce_bytes_per_rank": 2 * (n - 1) / n * total * g_bytes}


def ps_ops(cfg: ModelConfig, layout: Layout, link: Link) -> list[CommOp]:
    """The push and the pull as the busiest rank sees them, timed at a server's link."""
    summary = ps_summary(cfg, layout)
    n, s = layout.dp, layout.ps_servers
    ranks = n + s

    def op(name: str, sent: float, at_server: float, overlap: str) -> CommOp:
        return CommOp(group="ps", op=name, ranks=ranks, message_bytes=at_server / n, calls=n,
                      algorithm="p2p", bytes_sent=sent,
                      time_s=n * link.alpha_s + at_server * link.beta_s_per_byte,
                      overlap=overlap)

    return [op("push", summary["worker_sent_bytes_per_step"],
               summary["server_recv_bytes_per_step"], "step"),
            op("pull", summary["server_sent_bytes_per_step"],
               summary["server_sent_bytes_per_step"], "none")]
