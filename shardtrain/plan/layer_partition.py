"""ZeRO-3's two partitions in the planner: flat (every rank 1/N_d of every unit:
all-gathers and reduce-scatters) and layer (`parallel.zero_partition = layer`: each rank
owns whole units, broadcast from their owner, gradients reduced to it; seed 001's
inter-layer partitioning, parallel/zero/layer.py).

The runtime's units (cost/units.py `unit_key`, rank_states.py `rank0_tensors`) and its
owner deal (cost/units.py `layer_owners`) give each rank's exact share, so the figures
here are the runtime's to the byte:
- memory: the owner holds its units' fp32 parameters, gradient shards and optimizer state
  (16 bytes per element under fp32 AdamW); the flat partition holds 1/N_d of every unit,
  padded to a multiple of N_d (`compare_partitions`);
- bytes sent per step (the ledger's native convention, comm/ledger.py `native_volume`: a
  broadcast's root sends (N - 1) S, the others nothing; a reduce's non-roots send S, the
  root nothing): per micro-batch the owner of a unit of S gathered bytes broadcasts it
  twice (before its forward and its backward; the embedding's lookup tables once, before
  forward: cost/units.py `backward_reads_params`), and every other rank sends its
  gradient, G bytes in the reduce dtype, once.
Pure arithmetic, like the rest of plan/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardtrain.config import ModelConfig
from shardtrain.cost.units import ROUNDED, backward_reads_params, layer_owners, unit_key
from shardtrain.plan.layout import Layout, PlanError
from shardtrain.plan.memory import REDUCE_BYTES, STATE_BYTES, ModelStates
from shardtrain.plan.ops import CommOp, Placement, collective
from shardtrain.plan.rank_states import rank0_tensors


@dataclass(frozen=True)
class Unit:
    elements: int
    gather_bytes: int  # one gather of the unit (a rounded half travels in 16 bits)
    grad_bytes: int  # its gradient on the wire (train.grad_reduce_dtype)
    gathers: int = 2  # per micro-batch: forward and backward, the lookup tables forward only


def zero3_units(cfg: ModelConfig, layout: Layout) -> list[Unit]:
    """The runtime's ZeRO-3 units of a dense model, in forward order (under the `bf16`
    convention every value travels in 16 bits)."""
    lay = layout
    if lay.zero != 3:
        raise PlanError(f"layout zero={lay.zero}: the partitions compared here are ZeRO-3's")
    amp, half = lay.precision == "amp", lay.precision == "bf16"
    units: dict[tuple[int, int, int], int] = {}
    for name, n in rank0_tensors(cfg, lay):
        key = unit_key(name, tied=cfg.tie_embeddings, n_layers=cfg.n_layers, rounded=amp,
                       blocks=lay.unit_blocks)
        units[key] = units.get(key, 0) + n
    grad = REDUCE_BYTES[lay.reduce_dtype or ("bf16" if half else "fp32")]
    return [Unit(n, (2 if key[2] == ROUNDED or half else 4) * n, grad * n,
                 2 if backward_reads_params(key) else 1)
            for key, n in sorted(units.items())]


def owners(units: list[Unit], ranks: int) -> list[int]:
    return layer_owners([u.elements for u in units], ranks)


def layer_sent_bytes(units: list[Unit], ranks: int, rank: int | None, microbatches: int
                     ) -> dict[str, int] | list[dict[str, int]]:
    """Bytes `rank` sends per step under the layer partition: {"param": its broadcasts,
    "grad": its reduces} (module docstring); every rank's, in rank order, when `rank` is
    None."""
    m, grads = microbatches, sum(u.grad_bytes for u in units)
    out = [{"param": 0, "grad": m * grads} for _ in range(ranks)]
    for u, owner in zip(units, owners(units, ranks)):
        out[owner]["param"] += u.gathers * m * (ranks - 1) * u.gather_bytes
        out[owner]["grad"] -= m * u.grad_bytes  # the owner reduces nothing of its own
    return out if rank is None else out[rank]


def flat_sent_bytes(units: list[Unit], ranks: int, microbatches: int) -> dict[str, int]:
    """Bytes every rank sends per step under the flat partition (ring all-gathers and
    reduce-scatters of each unit padded to a multiple of N_d; buckets change the calls,
    not the bytes)."""
    def ring(n: int, width: int) -> int:
        padded = -(-n // ranks) * ranks
        return (ranks - 1) * padded * width // ranks

    gathered = sum(u.gathers * ring(u.elements, u.gather_bytes // u.elements) for u in units)
    reduced = sum(ring(u.elements, u.grad_bytes // u.elements) for u in units)
    return {"param": microbatches * gathered, "grad": microbatches * reduced}


def layer_states(cfg: ModelConfig, layout: Layout) -> ModelStates:
    """The busiest rank's model states under the layer partition: its units whole."""
    units = zero3_units(cfg, layout)
    held = [0] * layout.nd
    for u, owner in zip(units, owners(units, layout.nd)):
        held[owner] += u.elements
    p, g, m, o = (b * max(held) for b in STATE_BYTES[layout.precision])
    return ModelStates(params=p, grads=g, master=m, optimizer=o)


def layer_ops(cfg: ModelConfig, layout: Layout, where: Placement) -> list[CommOp]:
    """The dp traffic of the rank sending the most under the layer partition: its
    broadcasts (per micro-batch, 2 of each unit it owns, 1 of the lookup tables) and its
    reduces (1 per micro-batch and unit it does not), each priced as the cost model's
    native collective of the mean size."""
    lay, n, m = layout, layout.nd, layout.microbatches
    units = zero3_units(cfg, lay)
    if n <= 1:
        return []
    sent = layer_sent_bytes(units, n, None, m)
    rank = max(range(n), key=lambda r: sum(sent[r].values()))
    owned = [o == rank for o in owners(units, n)]
    mine = [u for u, own in zip(units, owned) if own]
    others = [u for u, own in zip(units, owned) if not own]
    ops = []
    for op, group, calls, size, nbytes in (
            ("broadcast", mine, m * sum(u.gathers for u in mine), "gather_bytes",
             sent[rank]["param"]),
            ("reduce", others, m * len(others), "grad_bytes", sent[rank]["grad"])):
        if calls:
            mean = sum(getattr(u, size) for u in group) / len(group)
            one = collective("dp", op, n, mean, calls, where, "compute")
            ops.append(dataclasses.replace(one, bytes_sent=nbytes))
    return ops


def compare_partitions(cfg: ModelConfig, layout: Layout) -> dict[str, dict[str, float]]:
    """Model-state bytes of the busiest rank and bytes sent per step (the most any rank
    sends) under each partition of ZeRO-3: {"flat": {...}, "layer": {...}}."""
    lay, per = layout, sum(STATE_BYTES[layout.precision])  # bytes of state per element
    units, n = zero3_units(cfg, lay), lay.nd
    held = [0] * n
    for u, owner in zip(units, owners(units, n)):
        held[owner] += per * u.elements
    flat_states = per * sum(-(-u.elements // n) for u in units)
    layer_sent = [sum(r.values()) for r in layer_sent_bytes(units, n, None, lay.microbatches)]
    return {"flat": {"states_bytes": flat_states,
                     "sent_bytes": sum(flat_sent_bytes(units, n, lay.microbatches).values())},
            "layer": {"states_bytes": max(held), "sent_bytes": max(layer_sent),
                      "min_states_bytes": min(held)}}
