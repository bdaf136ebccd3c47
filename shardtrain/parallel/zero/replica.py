"""ZeRO's update half as the replica sync modes see it (parallel/replica/view.py): the
gradient shards the shard optimizer reads, its fp32 master shards, and the refresh a step
ends with (16-bit shards cast from the masters, then stages 1-2 all-gather them)."""

from __future__ import annotations

from typing import Any

import torch

from shardtrain.parallel.pieces import zero_like_load, zero_like_pieces
from shardtrain.parallel.replica.view import ReplicaView


def zero_view(model: Any) -> ReplicaView:
    """`model`: a ZeroModel (zero/model.py)."""
    units, optimizer, shards = model.units, model.optimizer, model.shards
    masters = [optimizer.master(k) for k in range(len(units))]  # [shard] fp32 each

    @torch.no_grad()
    def refresh() -> None:
        if not model.offload_params:  # an offloaded ZeRO-3 shard is its master
            for u, m in zip(units, masters):
                if u.shard.data_ptr() != m.data_ptr():  # a separate master (16-bit compute)
                    u.shard.copy_(m)
        model.gather_shards()

    return ReplicaView(
        grads=lambda: [u.grad_shard for u in units], weights=masters, refresh=refresh,
        pieces=lambda key_of, tensors: zero_like_pieces(shards, units, tensors, key_of),
        load=lambda reader, key_of, tensors: zero_like_load(shards, units, reader, key_of,
                                                            tensors))
