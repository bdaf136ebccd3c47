"""Activation offload's planner terms (train.activation_offload = cpu; the runtime is
parallel/offload_activations.py, docs/recompute.md "Activation offload").

What a layer saves for backward (`per_layer`: plan/memory.layer_activation_bytes, after
recomputation: selective offloads q, k, v and what the core does not rebuild, full only the
block input) goes to host memory during forward and comes back one layer ahead in backward:

- host: every layer of every micro-batch in flight on the busiest stage, the bytes the
  device would otherwise hold (layers x in-flight x per_layer);
- device: a two-layer window (the layer computing and the one copying down, of whichever
  micro-batch; in backward the layer computing and the one reloading), or all of them
  where the rank holds fewer;
- moved per step and direction: every layer of each of the step's m micro-batches
  (layers x m x per_layer), down in forward and up in backward;
- time: each direction over the host link at `host_bw` (cost/hardware.py: bytes/s per GPU
  and direction, PCIe Gen4 x16 about 32 GB/s, Gen5 64 GB/s; the seed's arithmetic of bytes
  over PCIe bandwidth). The copies run on a side stream beside the compute, so the step
  pays only what a direction's transfer takes beyond the compute it overlaps: forward's
  copies down behind the forward, the reloads behind the backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class OffloadTerms:
    host_bytes: float  # held in host memory at the peak
    device_bytes: float  # the device window (two layers)
    moved_bytes: float  # per step, each direction (down in forward, up in backward)

    def transfer_s(self, host_bw: float) -> float:
        """Seconds both directions take over the host link, without overlap."""
        return 2 * self.moved_bytes / host_bw

    def exposed_s(self, host_bw: float, *, forward_s: float, backward_s: float) -> float:
        """What the step pays: each direction's transfer beyond the compute beside it."""
        one_way = self.moved_bytes / host_bw
        return max(0.0, one_way - forward_s) + max(0.0, one_way - backward_s)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def offload_terms(per_layer: float, *, layers: int, in_flight: float,
                  microbatches: int) -> OffloadTerms:
    """The terms for one rank holding `layers` layers of `per_layer` bytes each per
    micro-batch, `in_flight` micro-batches at the peak, m = `microbatches` per step."""
    return OffloadTerms(host_bytes=per_layer * layers * in_flight,
                        device_bytes=min(2.0, layers * in_flight) * per_layer,
                        moved_bytes=per_layer * layers * microbatches)
