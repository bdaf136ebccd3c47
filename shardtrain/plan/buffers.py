"""The step's transient bytes beyond the model states and the saved activations, for one
rank of shardtrain's runtime without a pipeline (memory.py adds them as `buffers`).

Backward passes through moments that each hold something else; the peak is the largest
(with the saved activations, all of them alive at backward's start, counted as if still
whole: an upper bound as backward releases them):

- the loss (every layout): its backward holds the gradients of the log-probabilities and of
  the logits, two fp32 [n, V'] (V' = V / t) beside the saved ones: 2 L, L = 4 n V'
  (`loss_moment`: 3 L and more under tp, whose forward holds more).
- ZeRO-2 and 3 (zero/reducer.py, zero/gather.py): full gradients live only in the buckets
  (comm.bucket_mb: whole consecutive units, in the order backward completes them,
  cost/units.py `coalesce`): the bucket being filled and at most the one before it still in
  flight (when no larger). The head's moment: its weight's gradient (and under ZeRO-3 its
  gathered weight; the logits' gradient replaces the released log-probabilities). A
  block's: the buckets held, and under ZeRO-3 two gathered units (the one computing, the
  one prefetched), each of parallel.zero_unit_blocks blocks (`block_units`). The end
  of backward (the saved activations gone): the last buckets, the embedding's dense
  gradient, a tied table's head contribution (autograd holds it from the head's
  backward, zero/reducer.py), under ZeRO-3 a tied table gathered again (the head's unit;
  an untied table's unit is gathered for forward only, its lookup's backward reading the
  token ids alone: cost/units.py `backward_reads_params`).
- ZeRO-1 and plain DP keep full gradients in their states; their buckets' copies (two
  buckets of comm.bucket_mb: a 16-bit reduce dtype's copies, ZeRO-1's packed buckets) are
  `sync_bytes`, held at the end of backward, with the loss's moment before it.
- amp (autocast, `weight_casts`): each linear keeps the 16-bit copy of its fp32 weight that
  autocast made, from its forward to its backward: 2 bytes per weight autocast rounds
  (cost/units.py `rounded_for_compute`), and a tied table's copy for the head. ZeRO-3
  gathers those weights in 16 bits already: only the tied table (gathered in fp32) is
  copied.
Units on a rank, in backward order: the head (V' C; a tied table is reduced last, after
the embedding's position table), the blocks, the embedding (V' C, and GPT-2's position
table). Pure arithmetic like the rest of plan/.
"""

from __future__ import annotations

from shardtrain.config import ModelConfig
from shardtrain.cost.units import coalesce
from shardtrain.plan.layout import Layout
from shardtrain.plan.partition import RankParams

GRAD_BYTES = 4  # full gradients: fp32 under fp32 and amp (parallel/precision.py)


def loss_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int) -> float:
    """L: one fp32 [n, V'] of the loss, n = micro_batch x seq_len / cp tokens."""
    n = layout.micro_batch * (seq_len // layout.cp)
    return 4.0 * n * -(-cfg.vocab_size // layout.tp)


def loss_moment(cfg: ModelConfig, layout: Layout, *, seq_len: int) -> float:
    """The loss's largest transient beside its saved L: its backward's two gradients (2 L);
    under tp the vocabulary-parallel forward's fp32 logits, their masked copy and the
    shifted logits' exp beside the shifted ones (3 L; parallel/tensor/vocab.py), and under
    autocast the 16-bit logits besides (L / 2)."""
    tp, amp = layout.tp > 1, layout.precision != "fp32"
    return (3.0 if tp else 2.0) * loss_bytes(cfg, layout, seq_len=seq_len) \
        + (loss_bytes(cfg, layout, seq_len=seq_len) / 2 if tp and amp else 0.0)


def held_buckets(sizes: list[float], cap: float) -> tuple[list[float], bool]:
    """Full-gradient bytes the ZeRO-2/3 reducer holds while each bucket fills (sizes: the
    units' gradient bytes in backward order): the bucket, plus the previous one when it
    was left in flight (no larger than this one; zero/reducer.py); and whether the last
    bucket packs several units (a unit alone is reduced from its own gradient; packed,
    the last unit's gradient is copied in beside itself)."""
    groups = coalesce(sizes, cap)
    buckets = [sum(sizes[i] for i in b) for b in groups]
    held = [b + (buckets[k - 1] if k and buckets[k - 1] <= b else 0.0)
            for k, b in enumerate(buckets)]
    return held, len(groups[-1]) > 1


def block_units(layers: int, layer: float, blocks: int) -> list[float]:
    """Parameters of each ZeRO unit of transformer blocks on a rank, in forward order:
    `layers` blocks of `layer` parameters, `blocks` of them per unit
    (parallel.zero_unit_blocks, cost/units.py `unit_key`; the last unit takes the rest)."""
    return [layer * min(blocks, layers - i) for i in range(0, layers, blocks)]


def gathered_units(units: list[float]) -> float:
    """The most parameters of block units gathered at once under ZeRO-3: the one computing
    and the next one, prefetched (one unit of all blocks: itself)."""
    return max((a + b for a, b in zip(units, units[1:])), default=units[0] if units else 0.0)


def zero_moments(cfg: ModelConfig, layout: Layout, ranks: RankParams, *, seq_len: int,
                 activations: float, bucket_bytes: float, gather_bytes: float,
                 head_gather: float) -> float:
    """The largest transient of a ZeRO-2/3 step without a pipeline (module docstring);
    `gather_bytes`, `head_gather`: bytes per gathered parameter of a block and of the head's
    unit (ZeRO-3; under amp a block's and an untied head's weights travel in 16 bits)."""
    vocab = -(-cfg.vocab_size // layout.tp) * cfg.dim  # elements of a vocabulary unit
    table = vocab + (cfg.max_seq_len * cfg.dim if cfg.style == "gpt2" else 0)
    units = block_units(ranks.layers, ranks.layer, layout.unit_blocks)
    blocks = [GRAD_BYTES * n for n in units]
    if cfg.tie_embeddings:
        sizes = blocks + [GRAD_BYTES * vocab]
    else:
        sizes = [GRAD_BYTES * vocab] + blocks + [GRAD_BYTES * table]
    held, packed = held_buckets(sizes, bucket_bytes)
    z3, tied = layout.zero == 3, cfg.tie_embeddings
    head = GRAD_BYTES * vocab + (head_gather * vocab if z3 else 0.0)
    # a block's backward: a bucket it fills (not the last when that is the table's alone,
    # filled after the blocks: `end`) and two block units gathered
    filled = held if packed else held[:-1]
    during = max(filled, default=0.0) + (gather_bytes * gathered_units(units) if z3 else 0.0)
    end = held[-1] + GRAD_BYTES * table * (int(tied) + int(packed)) \
        + (head_gather * vocab if z3 and tied else 0.0)
    return max(loss_moment(cfg, layout, seq_len=seq_len), head, during, end - activations)


def weight_casts(cfg: ModelConfig, layout: Layout, ranks: RankParams) -> float:
    """Bytes of autocast's 16-bit weight copies alive from forward to backward (amp; module
    docstring)."""
    rounded = 0.0 if layout.zero == 3 else ranks.total - ranks.kept - ranks.kept_expert
    tied = -(-cfg.vocab_size // layout.tp) * cfg.dim if cfg.tie_embeddings else 0
    return 2.0 * (rounded + tied)
