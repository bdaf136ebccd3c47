"""ZeRO-3's forward events: the moments a model, or a pipeline stage's chunk, starts computing
with another set of units (gather.py gathers each event's units there, and the next
`parallel.zero_prefetch` events' ahead of it).

A chunk is the whole model (no pipeline) or one of a pipeline stage's chunks
(pipeline/stage.py `StageChunk`: a run of blocks, with the embedding before them on the
first stage's first chunk and the final norm and head after them on the last stage's last
chunk). Its events in forward order: the chunk itself (its forward pre-hook; the units of
the embedding's tables when it embeds tokens: the position table's, and the token
table's, which is the head's unit when tied, cost/units.py), each block (its dense unit
and under expert parallelism its experts' unit; the last block's holds the final norm) --
or, with `parallel.zero_unit_blocks` = k, each run of k blocks sharing those units --
then the head (the head's unit: its weight, or the tied token table; with multi-token
prediction the modules, in the head's unit, and the token table's unit again).
"""

from __future__ import annotations

from torch import nn

from shardtrain.cost.units import BLOCK, EMBEDDING, HEAD
from shardtrain.parallel.zero.units import FlatUnit

Event = tuple[nn.Module, list[FlatUnit]]  # (module whose forward pre-hook starts it, units)


def forward_events(chunk: nn.Module, units: list[FlatUnit]) -> list[Event]:
    """The events of `chunk` (module docstring) over `units` (the rank's, forward order)."""
    owner = getattr(chunk, "stage", chunk)  # a StageChunk's parameters are its stage's
    first, last = getattr(chunk, "first", True), getattr(chunk, "last", True)
    indices = getattr(chunk, "indices", range(len(owner.layers)))
    tables = [u for u in units if u.key[0] == EMBEDDING
              or any(n.startswith("tok_emb.") for n in u.names)]
    events: list[Event] = [(chunk, tables if first else [])]
    k = units[0].blocks if units else 1  # blocks per unit (parallel.zero_unit_blocks)
    for i in indices:
        block = owner.layers[str(i)] if isinstance(owner.layers, nn.ModuleDict) \
            else owner.layers[i]
        # A unit of k blocks is keyed by its first block (cost/units.py `unit_key`); the
        # blocks of one unit are one event, started by the first one's pre-hook.
        block_units = [u for u in units if u.key[:2] == (BLOCK, i - i % k)]
        if len(events) > 1 and block_units and events[-1][1] == block_units:
            continue
        events.append((block, block_units))
    if last:  # the multi-token prediction modules (model/mtp.py) run in the head's event,
        # after it, looking tokens up again: the table's unit is the head's event's too
        again = [u for u in tables if u.key[0] != HEAD] if getattr(owner, "mtp", None) else []
        events.append((owner.head, [u for u in units if u.key[0] == HEAD] + again))
    return events


def stage_events(chunks: list[nn.Module], units: list[FlatUnit]) -> list[Event]:
    """The events of a rank's chunks in local order (the order of their first forwards in
    a step); a unit no event names (none in the models built here) joins the first."""
    events = [e for chunk in chunks for e in forward_events(chunk, units)]
    named = {u for _, event_units in events for u in event_units}
    module, first = events[0]
    events[0] = (module, first + [u for u in units if u not in named])
    return events
