"""Context parallelism: every sequence split over the cp ranks (contiguous or zig-zag,
split.py) and attention computed across them, by ring attention (K/V blocks travel the
ring; Liu et al. 2023; causal work balanced by the zig-zag split, after the imbalance
Brandon et al. 2023 describe: ring.py) or by Ulysses (an all-to-all from a sequence split
to a head split; Jacobs et al. 2023: ulysses.py). `ContextAttention` is the model's
attention core under a cp layout."""

from shardtrain.parallel.context.core import ContextAttention
from shardtrain.parallel.context.ring import (TAG_DKV, TAG_KV, ring_attention,
                                              simulated_ring_attention)
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.context.timer import ComputeTimer
from shardtrain.parallel.context.ulysses import TAG_A2A, ulysses_attention

__all__ = ["ComputeTimer", "ContextAttention", "SequenceSplit", "TAG_A2A", "TAG_DKV", "TAG_KV",
           "ring_attention", "simulated_ring_attention", "ulysses_attention"]
