"""The expert-parallel exchange of group-limited routing: each token travels once per
expert group it may use, not once per slot (DeepSeek-V3 sec. 2.1.2 and 3.2.2: node-limited
routing bounds each token's all-to-all traffic).

Routing limited to g of G groups (model/moe_routing.py) keeps, per token, its g groups
`Routing.groups` [T, g]. Placed whole on ep ranks (G divisible by ep: rank j holds groups
j G/ep .. (j+1) G/ep - 1, which are its experts), a token's k slots then fall on at most g
ranks. This exchange sends one row per (token, kept group): the token's input [C] and the
gates of the group's E/G experts [E/G] fp32 (-1 for the experts it did not choose, or whose
slot a capacity dropped: gates are >= 0). The owner runs each chosen (row, expert) pair through its experts
as one grouped computation, weights the outputs by their gates and sums them per row, and
sends one row [C] back, which the sender adds into its token. Exactly T g rows go out and
come back (where the slot exchange of layers.py sends T k), so the ledger equals the
planner (plan/traffic.py). It is used where it sends less: g < k.

Messages per MoE forward, all tag `ep`: the counts [ep, G/ep + 1] int64 (rows per group,
and the slots in them, so that the owner sizes its work with the exchange's one host sync),
the rows, their gates, and the summed rows back; backward sends the gradients of the last
three. Shape legend: T tokens, g kept groups, P = E / G experts per group, R received rows,
S received slots, C dim, L local experts, Gl = G / ep local groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardtrain.comm import Communicator
from shardtrain.model.moe import Dispatch
from shardtrain.model.moe_routing import Routing
from shardtrain.parallel.expert.a2a import all_to_all


def grouped_exchange(tokens: torch.Tensor, r: Routing, d: Dispatch, comm: Communicator,
                     n_groups: int, experts: Callable[[torch.Tensor, Dispatch], torch.Tensor]
                     ) -> torch.Tensor:
    """tokens [T, C] -> the routed experts' combined output [T, C] (module docstring);
    `experts(x [S, C], local Dispatch) -> [S, C]` runs the L local experts."""
    n_tokens, n_experts = r.probs.shape
    per, kept = n_experts // n_groups, r.groups.shape[1]
    local_groups = n_groups // comm.size
    # The kept slots' gates as [T, E], -1 where no kept slot is (not chosen, or dropped by
    # a capacity): the owner finds its slots by the sign, whatever a gate's value
    gates = r.probs.new_full((n_tokens, n_experts), -1.0).index_put(
        (d.token, d.expert), torch.where(d.keep, d.weight.float(), -1.0))
    row_gates = gates.view(n_tokens, n_groups, per).gather(
        1, r.groups[..., None].expand(-1, -1, per)).reshape(-1, per)  # [T g, P]
    row_group = r.groups.reshape(-1)  # [T g]
    order = row_group.argsort(stable=True)  # group-major: rank-major
    row_token = torch.arange(n_tokens, device=tokens.device).repeat_interleave(kept)[order]
    per_group = torch.zeros(n_groups, dtype=torch.int64, device=tokens.device).scatter_add_(
        0, row_group, torch.ones_like(row_group))  # [G]
    slots_to = d.counts.view(comm.size, -1).sum(1, keepdim=True)  # [ep, 1] kept slots
    send = torch.cat([per_group.view(comm.size, local_groups), slots_to], 1)  # [ep, Gl + 1]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send.contiguous(), tag="ep")
    sent, got = torch.stack([send, recv]).tolist()  # the one host sync: splits are host ints
    in_rows = [sum(row[:-1]) for row in sent]
    out_rows = [sum(row[:-1]) for row in got]
    x = all_to_all(tokens[row_token], comm, out_rows, in_rows)  # [R, C], source-major
    g = all_to_all(row_gates[order], comm, out_rows, in_rows)  # [R, P]
    # Each received row's local group: segments (source, local group) in order
    segment = torch.repeat_interleave(
        torch.arange(recv[:, :-1].numel(), device=x.device), recv[:, :-1].reshape(-1),
        output_size=x.shape[0])  # [R]
    n_slots = sum(row[-1] for row in got)
    pairs = torch.nonzero_static(g.detach() >= 0, size=n_slots)  # [S, 2] (row, column)
    # Exactly S pairs in a real exchange; a dry run's fake one (train/start/dryrun.py)
    # receives gates that disagree with its counts: missing pairs come as -1, and compute
    # nothing (weight 0), surplus ones are cut
    real = pairs[:, 0] >= 0  # [S]
    row, column = pairs[:, 0].clamp(min=0), pairs[:, 1].clamp(min=0)
    local_expert = (segment[row] % local_groups) * per + column  # [S]
    by_expert = local_expert.argsort(stable=True)
    row, column, local_expert, real = (row[by_expert], column[by_expert],
                                       local_expert[by_expert], real[by_expert])
    counts = torch.zeros(local_groups * per, dtype=torch.int64, device=x.device).scatter_add_(
        0, local_expert, torch.ones_like(local_expert))  # [L]
    local = Dispatch(token=row, expert=local_expert, weight=g.new_ones(n_slots),
                     keep=torch.ones_like(row, dtype=torch.bool), counts=counts,
                     offsets=counts.cumsum(0).to(torch.int32), routed=counts)
    y = experts(x[row], local)  # [S, C]
    y = y * torch.where(real, g[row, column], 0.0)[:, None].to(y.dtype)
    summed = y.new_zeros(x.shape[0], y.shape[-1]).index_add_(0, row, y)  # [R, C]
    back = all_to_all(summed, comm, in_rows, out_rows)  # [T g, C] in `order`
    return back.new_zeros(n_tokens, back.shape[-1]).index_add_(0, row_token, back)
