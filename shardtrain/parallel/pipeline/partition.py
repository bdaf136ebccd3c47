"""Which transformer layers each pipeline stage holds.

The embedding sits on the first stage, the final norm, head and loss on the last; the layers
are cut into pp x v contiguous ranges, one per virtual stage. Chunk c of stage s is virtual
stage g = c pp + s and holds the g-th range (Narayanan et al. 2021, sec. 2.2), so a
micro-batch visits stage 0, 1, ..., pp - 1, then stage 0 again for the next chunk. Under
the V placement (ZB-V, DualPipeV: schedules.Placement) stage s holds virtual stages s and
2 pp - 1 - s: stage 0 then holds the embedding and the head.

With one chunk per stage the cut balances a cost -- FLOPs (the step time is the slowest
stage's) or parameters (memory) -- counting the embedding on the first stage and the head
on the last (by parameters with the multi-token prediction modules and their token-table
copy: model/mtp.py; by FLOPs without them): the contiguous split that minimises the
largest stage's cost (each stage at least one layer). Interleaving needs equal chunks: the layer count must divide by pp x v
(config validation says so before launch).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from shardtrain.config import ModelConfig
from shardtrain.cost.counts import forward_flops_per_token, mtp_params, norm_params, param_counts


def stage_costs(cfg: ModelConfig, *, by: str = "flops", seq_len: int = 1
                ) -> tuple[float, float, float]:
    """(one layer, extra on the first stage, extra on the last stage) by FLOPs per token or
    by parameters. FLOPs: the embedding is a lookup (free), the head a [dim, vocab] matmul."""
    head = cfg.vocab_size * cfg.dim
    if by == "flops":
        # The multi-token prediction modules (model/mtp.py) on the last stage are left out:
        # cut by their FLOPs, the layers they displace would go to earlier stages, which
        # hold more micro-batches in flight, and the planner's busiest stage (ceil(L / pp)
        # layers) would no longer be the runtime's; the cut stays the plain model's.
        plain = replace(cfg, mtp_depth=0)
        layer = (forward_flops_per_token(plain, seq_len) - 2.0 * head) / cfg.n_layers
        return layer, 0.0, 2.0 * head
    if by == "params":
        counts = param_counts(cfg)
        first = counts.embedding - (0 if cfg.tie_embeddings else head)  # tokens (+ positions)
        copy = head if cfg.mtp_depth and not cfg.tie_embeddings else 0  # the MTP's table
        return float(counts.per_layer), float(first), \
            float(head + norm_params(cfg) + mtp_params(cfg) + copy)
    raise ValueError(f"balance by {by!r}: one of flops, params")


def layer_ranges(n_layers: int, pp: int, v: int = 1, *, shape: str = "loop",
                 costs: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> list[list[range]]:
    """[stage][chunk] -> the range of layer indices it holds; `shape`: the placement."""
    from shardtrain.parallel.pipeline.schedules import Placement  # schedules is pure data

    if not 1 <= pp <= n_layers:
        raise ValueError(f"{n_layers} layers cannot fill {pp} pipeline stages")
    if v > 1:
        if n_layers % (pp * v):
            raise ValueError(f"{n_layers} layers do not split into pp x v = {pp * v} equal chunks")
        k, place = n_layers // (pp * v), Placement(pp, v, shape)
        return [[range(place.virtual(s, c) * k, (place.virtual(s, c) + 1) * k)
                 for c in range(v)] for s in range(pp)]
    bounds = _balanced_bounds(n_layers, pp, *costs)
    return [[range(bounds[s], bounds[s + 1])] for s in range(pp)]


def _balanced_bounds(n: int, pp: int, layer: float, first: float, last: float) -> list[int]:
    """Cut points 0 = b_0 < ... < b_pp = n minimising max over stages of their cost."""

    def cost(i: int, j: int, s: int) -> float:
        return (j - i) * layer + (first if s == 0 else 0.0) + (last if s == pp - 1 else 0.0)

    @cache
    def best(s: int, i: int) -> tuple[float, tuple[int, ...]]:
        """Stages s.. over layers i..n: (largest cost, cut points after i)."""
        if s == pp - 1:
            return cost(i, n, s), (n,)
        options = []
        for j in range(i + 1, n - (pp - s - 1) + 1):  # leave a layer for each later stage
            rest, cuts = best(s + 1, j)
            options.append((max(cost(i, j, s), rest), (j, *cuts)))
        return min(options)  # ties: the earliest cut, i.e. fewer layers on earlier stages

    return [0, *best(0, 0)[1]]
