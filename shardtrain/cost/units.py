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

Backward completes the units in reverse forward order, with one exception
(`launch_order`): a tied table's gradient is complete only after the embedding's backward,
the last of all (autograd sums the head's and the embedding's contributions before the
table's gradient hook runs), so the tied unit is reduced last although it is the head's.
Launched in its forward place, first, it would hold back every unit's reduce-scatter (and
under ZeRO-3 every unit's release) until the end of backward.

Gradients are reduce-scattered in buckets of whole consecutive units in that order
(`coalesce`, comm.bucket_mb), so the planner counts the runtime's collectives.

Under ZeRO-3 with a 16-bit compute dtype each unit is split in two, gathered in two dtypes
(`rounded`): the parameters autocast rounds to the compute dtype before every use
(`rounded_for_compute`: the weights of linears and experts, LoRA's factors) are gathered
already rounded, half the bytes, and compute exactly the numbers they would in fp32 under
autocast; the others (norms, embedding tables, the router, biases) are gathered in fp32 so
every layout keeps computing the single process's numbers (parallel/precision.py).
"""

from __future__ import annotations

import heapq

EMBEDDING, BLOCK, HEAD = 0, 1, 2
KEPT, ROUNDED = 0, 1  # the halves of a split unit: gathered in fp32, in the compute dtype

# Modules whose `weight` feeds only matmuls (F.linear under autocast, the experts' grouped
# matmul: model/moe.py casts to autocast's dtype). Biases are not listed: a row-parallel
# linear adds its bias to the fp32 residual after the all-reduce (tensor/layers.py).
_LINEARS = frozenset({"wq", "wk", "wv", "wo", "w1", "w2", "w3", "head",
                      "wq_a", "wq_b", "wkv_a", "wkv_b"})  # the last four: model/mla.py


def rounded_for_compute(name: str) -> bool:
    """Whether autocast rounds parameter `name` to the compute dtype before every use, so a
    copy rounded once computes the same numbers. An allow-list: a parameter not named here
    is kept in fp32 (correct, only more bytes)."""
    parts = name.split(".")
    leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""
    if leaf in ("lora_a", "lora_b"):
        return True
    if owner == "experts":
        return leaf in ("w1", "w2", "w3")
    return leaf == "weight" and owner in _LINEARS


def unit_key(name: str, *, tied: bool, n_layers: int, rounded: bool = False,
             blocks: int = 1) -> tuple[int, int, int]:
    """Forward-order key of the unit holding parameter `name` (a full-model name) of a
    model of `n_layers` blocks: (EMBEDDING, 0, h), (BLOCK, i, h) or (HEAD, 0, h), h the
    half of a split unit (`rounded`: ZeRO-3 gathering in a 16-bit compute dtype; module
    docstring), KEPT when units are not split. `blocks` (parallel.zero_unit_blocks): a unit
    holds that many consecutive blocks, keyed by its first, i - i % blocks."""
    half = ROUNDED if rounded and rounded_for_compute(name) else KEPT
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return (BLOCK, i - i % blocks, half)
    if name.startswith("norm."):
        return (BLOCK, (n_layers - 1) - (n_layers - 1) % blocks, half)
    if name.startswith("pos_emb.") or (name.startswith("tok_emb.") and not tied):
        return (EMBEDDING, 0, half)
    return (HEAD, 0, half)


def backward_reads_params(key: tuple[int, int, int]) -> bool:
    """Whether the backward of unit `key` reads its parameters' values. The embedding's
    unit holds only lookup tables (an untied token table, GPT-2's position table; a tied
    table is the head's): a lookup's backward scatters the output's gradient into the rows
    of the looked-up ids, the table entering through its shape alone (torch's
    `embedding_backward`), so ZeRO-3 gathers that unit for forward only, not again for
    backward as FSDP2 does (parallel/zero/gather.py; the planner's traffic follows)."""
    return key[0] != EMBEDDING


def completes_last(name: str, *, tied: bool) -> bool:
    """Whether parameter `name`'s gradient is complete only at the end of backward: a tied
    token table, used by the embedding (first in forward, last in backward) and the head."""
    return tied and name == "tok_emb.weight"


def launch_order(units: list[list[str]], *, tied: bool) -> list[int]:
    """Indices of `units` (each its parameter names; the units in forward order) in the
    order backward completes their gradients: reverse forward order, the unit holding a
    tied token table last (module docstring)."""
    backward = list(reversed(range(len(units))))
    return sorted(backward, key=lambda i: any(completes_last(n, tied=tied) for n in units[i]))


def coalesce(sizes: list[float], cap: float, groups: list[object] | None = None
             ) -> list[list[int]]:
    """Buckets of consecutive units (indices into `sizes`, each unit's gradient bytes on the
    wire, in launch order) that one reduce-scatter reduces together (comm.bucket_mb): a
    unit joins the open bucket while the bucket stays within `cap` bytes and the unit
    belongs to the same group (`groups[i]`: the ranks it is sharded over); a unit larger
    than `cap` is a bucket of its own. Units are never split or reordered, so each bucket
    is launched as soon as its last unit's gradients are complete."""
    buckets: list[list[int]] = []
    held = 0.0
    for i, size in enumerate(sizes):
        same = groups is None or (buckets and groups[buckets[-1][0]] is groups[i])
        if buckets and same and held + size <= cap:
            buckets[-1].append(i)
            held += size
        else:
            buckets.append([i])
            held = size
    return buckets


def layer_owners(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each unit (`sizes`: their elements, forward order) under ZeRO-3's layer
    partition (parallel.zero_partition = layer): whole units dealt out largest first, each
    to the rank holding the fewest bytes so far (the lowest such rank): round-robin by
    size, which balances the bytes greedily (seed 001's inter-layer partitioning)."""
    loads = [(0, r) for r in range(ranks)]  # a heap of (elements held, rank)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties in order
        load, owners[i] = heapq.heappop(loads)
        heapq.heappush(loads, (load + sizes[i], owners[i]))
    return owners
