"""Apply context parallelism to the plain model: every attention core becomes the cp
group's ring or Ulysses attention (core.py), over the split of each sequence the config
names (split.py).

What else context parallelism touches, and where: the pipeline hands each cp rank its slice
of every micro-batch (pipeline/runtime.py), the model's `positions` give RoPE and learned
positions the global position of each token held (model/transformer.py), and gradients,
ZeRO shards and losses live on the dp x cp group (`ParallelMesh.replica_dim`).
"""

from __future__ import annotations

from shardtrain.comm import Communicator
from shardtrain.config import Config
from shardtrain.model.transformer import Transformer
from shardtrain.parallel.context.core import ContextAttention
from shardtrain.parallel.context.split import SequenceSplit


def apply_context_parallel(model: Transformer, cp: Communicator,
                           cfg: Config) -> SequenceSplit | None:
    """Swap every block's attention core for one shared ContextAttention (one, so its
    `compute_s` is this rank's attention time over all layers); None without cp."""
    if cp.size == 1:
        return None
    p = cfg.parallel
    split = SequenceSplit(seq_len=cfg.train.seq_len, cp=cp.size, zigzag=p.cp_split == "zigzag")
    split.check()
    core = ContextAttention(cp, split, p.cp_mode)
    for block in [*model.layers, *(m.block for m in model.mtp or [])]:  # MTP's too
        block.attn.core = core
    return split


def context_cores(module) -> list[ContextAttention]:
    """The distinct context-parallel cores of a model or pipeline stage."""
    found: dict[int, ContextAttention] = {}
    for sub in module.modules():
        core = getattr(sub, "core", None)
        if isinstance(core, ContextAttention):
            found[id(core)] = core
    return list(found.values())
