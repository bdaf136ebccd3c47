"""Which parameters share one of ZeRO's flat units (pure, so the planner counts units as
the runtime builds them: parallel/zero/units.py, plan/rank_states.py).

A unit is gathered, reduced and freed as one (parallel/zero/gather.py), in forward order:
the embedding (token and position tables), one unit per transformer block, then the head
alone (a tied token table is the head's weight, so it joins the head; GPT-2's position
table stays in the embedding's unit, so that the first pipeline stage's copy of a tied
table is sharded as the last stage's is, and a checkpoint stores one copy of it). The final norm
joins the last block's unit rather than the head's: a head of one parameter lends its
vocabulary-sized gradient to the reduce-scatter as it is, where a unit of several must be
copied into one flat buffer, holding the model's largest gradient twice at the step's peak
(zero/reducer.py). The untied embedding is one parameter for the same reason (GPT-2's
position table, small, joins it).
"""

from __future__ import annotations

EMBEDDING, BLOCK, HEAD = 0, 1, 2


def unit_key(name: str, *, tied: bool, n_layers: int) -> tuple[int, int]:
    """Forward-order key of the unit holding parameter `name` (a full-model name) of a
    model of `n_layers` blocks: (EMBEDDING, 0), (BLOCK, i) or (HEAD, 0)."""
    if name.startswith("layers."):
        return (BLOCK, int(name.split(".")[1]))
    if name.startswith("norm."):
        return (BLOCK, n_layers - 1)
    if name.startswith("pos_emb.") or (name.startswith("tok_emb.") and not tied):
        return (EMBEDDING, 0)
    return (HEAD, 0)
