"""Which parameters one rank holds under a layout (before ZeRO sharding).

The planner reports the busiest rank: the pipeline stage with the most parameters. Each
stage holds ceil(L / (p v)) layers per virtual chunk; the first stage also holds the
token (and position) embedding, the last the final norm and the output head, or a copy of
the tied embedding as Megatron-LM keeps one (Narayanan et al. 2021), and the multi-token
prediction modules with (untied) a copy of the token table (model/mtp.py); under the V placement
(zbv, dualpipev) the first stage holds all of them, as one process does. Tensor parallelism
splits every dense weight t ways (vocabulary-parallel embedding and head; replicated norms,
biases and the MoE router are counted as split too, a < 0.1% simplification; latent
attention's down-projections, whole on every tp rank, are counted whole). Experts are
not split by tp: each tp rank holds whole experts (parallel/expert/layers.py) and expert
parallelism splits them ep ways, n_experts / ep per rank. With tp = pp = ep = 1 the total
is exactly `param_counts(cfg).total`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardtrain.config import ModelConfig
from shardtrain.cost.counts import (expert_params, kept_params, latent_params, mtp_params,
                                    norm_params, param_counts)
from shardtrain.parallel.pipeline.schedules import V_SHAPED
from shardtrain.plan.layout import Layout


@dataclass(frozen=True, kw_only=True)
class RankParams:
    dense: float  # replicated across a replica group's dp x cp (Layout.nd)
    expert: float  # replicated across its dp x cp / ep
    layer: float  # one transformer layer on this rank (a ZeRO-3 gather unit)
    layers: int  # transformer layers on this rank's stage (all virtual chunks)
    kept: float = 0.0  # of `dense`: not rounded by autocast (ZeRO-3 gathers them in fp32)
    kept_expert: float = 0.0  # of `expert`: the same (GPT-2 experts' biases)
    lookup: float = 0.0  # of `dense`: lookup tables ZeRO-3 gathers for forward only, on a
    # rank holding the embedding without a pipeline (cost/units.py `backward_reads_params`)
    moe_layers: int = 0  # of `layers`: mixture-of-experts blocks (the rest dense MLPs)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def layers_per_stage(cfg: ModelConfig, layout: Layout) -> int:
    chunks = layout.pp * layout.v
    return layout.v * math.ceil(cfg.n_layers / chunks)


def rank_params(cfg: ModelConfig, layout: Layout) -> RankParams:
    """The busiest rank's parameters (module docstring). With dense first blocks
    (model.moe_first_dense) the stage is taken to hold as many MoE blocks as it can, at
    most all of the model's: exact with one stage, an upper bound with several."""
    counts = param_counts(cfg)
    expert_layer = cfg.n_experts * expert_params(cfg)
    moe_layer = counts.per_layer - expert_layer if cfg.n_experts else 0  # its dense part
    plain_layer = counts.dense_layer
    layers = layers_per_stage(cfg, layout)
    moe = min(layers, cfg.moe_layers)
    outside = counts.total - cfg.moe_layers * (moe_layer + expert_layer) \
        - (cfg.n_layers - cfg.moe_layers) * plain_layer  # embeddings, head, final norm
    kept_layer, kept_expert, kept_outside = kept_params(cfg)
    kept_plain = kept_params(replace(cfg, n_experts=0))[0] if cfg.n_experts else kept_layer
    if layout.pp > 1 and layout.schedule not in V_SHAPED:  # the V: all on stage 0, as pp = 1
        word = cfg.vocab_size * cfg.dim
        first = counts.embedding - (0 if cfg.tie_embeddings else word)  # word (+ position)
        # the untied head, or the tied embedding's copy; the MTP modules and (untied) the
        # token table's copy they embed with (model/mtp.py)
        copy = word if cfg.mtp_depth and not cfg.tie_embeddings else 0
        last = norm_params(cfg) + word + mtp_params(cfg) + copy
        outside = max(first, last)
        kept_outside = first if first >= last else \
            kept_outside - first + (word if cfg.table_at_ends else 0)
    t = layout.tp
    lookup = 0.0
    # the embedding's unit on this rank, gathered for forward only; with multi-token
    # prediction it is gathered again for the modules' lookups (zero/events.py): no saving
    if (layout.pp == 1 or layout.schedule in V_SHAPED) and not cfg.mtp_depth:
        lookup = (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim) \
            + (cfg.max_seq_len * cfg.dim if cfg.style == "gpt2" else 0)
    expert = expert_layer / layout.ep  # replicated over tp, split over ep
    plain = layers - moe
    whole, whole_kept = (n * (t - 1) / t for n in latent_params(cfg))  # per block: mla's
    # latent projections and norms, whole on every tp rank (counted split above)
    return RankParams(dense=(moe * moe_layer + plain * plain_layer + outside) / t + layers * whole,
                      expert=moe * expert, layers=layers, moe_layers=moe,
                      layer=whole + max(moe_layer / t + expert if moe else 0,
                                        plain_layer / t if plain else 0),
                      kept=(moe * kept_layer + plain * kept_plain + kept_outside) / t
                      + layers * whole_kept,
                      kept_expert=moe * kept_expert / layout.ep, lookup=lookup / t)
