"""The expert-parallel MoE exchange: dispatch's sorted slots -> their experts' ranks ->
the local experts as one grouped computation -> back (GShard, Lepikhin et al. 2020).

Each rank routes and dispatches its own tokens (model/moe.py); its kept slots are grouped
by expert, and expert e lives on ep rank e // L (L = n_experts / ep), so the slots for rank
j are one contiguous run. The per-(rank, local expert) counts are exchanged by an
all-to-all on the device; then ONE host sync (`.tolist()`) reads them to size the uneven
all-to-all's buffers (the splits must be host integers): the price of dropless routing,
whose buffer sizes depend on the data. The received rows, source-major, are regrouped
expert-major for the grouped matmul and ungrouped before the inverse all-to-all. Shape
legend: N slots, K kept slots, R received rows, C dim, L local experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.config import ModelConfig
from shardtrain.model.experts import Experts
from shardtrain.model.moe import Dispatch, MoE
from shardtrain.model.moe_routing import Routing
from shardtrain.parallel.expert.a2a import all_to_all
from shardtrain.parallel.expert.grouped import grouped_exchange
from shardtrain.parallel.tensor.sharding import Placement


def exchange_counts(counts: torch.Tensor, comm: Communicator
                    ) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """counts [E] kept slots per expert -> (received counts [ep, L] on the device, and the
    sent and received counts as host lists: the one host sync)."""
    send = counts.view(comm.size, -1)  # [ep, L]: row j goes to rank j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send.contiguous(), tag="ep")
    sent, got = torch.stack([send, recv]).tolist()  # the host sync: splits are host ints
    return recv, sent, got


def run_experts(xs: torch.Tensor, d: Dispatch, comm: Communicator,
                experts: Callable[[torch.Tensor, Dispatch], torch.Tensor]) -> torch.Tensor:
    """xs [N, C] dispatch's sorted slots -> [N, C] their experts' outputs (zero rows after
    the kept ones). `experts(x [R, C], local Dispatch) -> [R, C]` runs the L local experts."""
    recv_counts, sent, got = exchange_counts(d.counts, comm)
    in_rows, out_rows = [sum(r) for r in sent], [sum(r) for r in got]
    kept = sum(in_rows)
    received = all_to_all(xs[:kept], comm, out_rows, in_rows)  # [R, C], source-major
    n_local = recv_counts.shape[1]
    flat = recv_counts.reshape(-1)  # [ep * L]: segment (s, l) at s * L + l
    segment = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat,
                                      output_size=received.shape[0])  # [R]
    local_expert = segment % n_local
    order = local_expert.argsort(stable=True)  # expert-major, sources in order within
    per_expert = recv_counts.sum(0)  # [L]
    local = Dispatch(token=order, expert=local_expert[order], weight=received.new_ones(
        received.shape[0], dtype=torch.float32),
        keep=torch.ones_like(order, dtype=torch.bool), counts=per_expert,
        offsets=per_expert.cumsum(0).to(torch.int32), routed=per_expert)
    y = experts(received[order], local)  # [R, C]
    y = y[order.argsort()]  # back to source-major
    back = all_to_all(y, comm, in_rows, out_rows)  # [K, C]
    return torch.cat([back, back.new_zeros(xs.shape[0] - kept, back.shape[-1])])


class ExpertSlice(Experts):
    """This rank's L = n_experts / ep experts, under the `Experts` parameter names; forward
    takes the whole Dispatch of the rank's own tokens and runs the exchange. Under
    group-limited routing with whole groups on each rank and fewer groups than slots per
    token (g < k), `grouped`: MoE sends each token once per group (`exchange_grouped`)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator):
        super().__init__(replace(cfg, n_experts=cfg.n_experts // comm.size))
        self.comm, self.n_groups = comm, cfg.moe_groups
        self.grouped = cfg.sends_per_group(comm.size)

    def forward(self, x: torch.Tensor, d: Dispatch) -> torch.Tensor:
        return run_experts(x, d, self.comm, super().forward)

    def exchange_grouped(self, tokens: torch.Tensor, r: Routing, d: Dispatch) -> torch.Tensor:
        """tokens [T, C] -> the combined routed output [T, C] (grouped.py)."""
        return grouped_exchange(tokens, r, d, self.comm, self.n_groups, super().forward)


def apply_expert_parallel(model: nn.Module, comm: Communicator) -> dict[str, Placement]:
    """Swap each MoE block's experts for this rank's slice (on the meta device: parallelize
    materialises them); returns their placements: block `comm.rank` of `comm.size` along
    dim 0 (the expert dim; the flat gpt2 biases' E * out), over the ep group."""
    placements = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        full = module.experts
        with torch.device("meta"):
            module.experts = ExpertSlice(module.cfg, comm)
        for leaf, p in full.named_parameters():
            placements[f"{name}.experts.{leaf}"] = Placement(
                dim=0, size=p.shape[0], parts=comm.size, index=comm.rank)
    return placements
