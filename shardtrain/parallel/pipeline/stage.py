"""One pipeline stage: the part of the plain model a rank holds, split from the outside.

`PipelineStage` registers the selected submodules of the (meta-built, possibly tensor-
parallel) model under the model's own attribute names -- `tok_emb`, `pos_emb`,
`layers.<i>`, `norm`, `head` -- so its parameter names, state-dict keys and initial values
are those of the single-process model: the same init-by-name draws the same tensors, and
full state dicts are the union of the stages'. Its chunks (one per virtual stage) are the
modules the executor runs: tokens -> activations on the first, activations -> logits on the
last, activations -> activations between.

Which stage holds the first and the last virtual stage follows the schedule's placement
(schedules.Placement): stage 0 and stage pp - 1 in the loop, stage 0 for both in the V.

Multi-token prediction (model/mtp.py): the last stage holds the modules and, as for a tied
head, a copy of the token table they embed the shifted tokens with: the depths' input
tokens are fed to the last stage (executor.py, `mtp_tokens`) rather than their embeddings
sent along the pipeline (D activations [B, S, C] more per micro-batch through every stage).

Tied embeddings (Press & Wolf 2017): under the V placement stage 0 holds both ends, and the
head shares the embedding's tensor as in the full model (no copy, nothing to exchange).
Otherwise the last stage keeps its own copy of the embedding
matrix as the head's weight, registered as `tok_emb` (the first name, as in the full model)
though only the head uses it there; the two copies start equal and stay equal because
their gradients are summed across the first and last stage every step (state.py), as
Megatron-LM does (Narayanan et al. 2021).
"""

from __future__ import annotations


import torch
from torch import nn

from shardtrain.config import Config
from shardtrain.model.mtp import MTPOutput, mtp_forward
from shardtrain.model.positions import Documents, position_ids, position_index
from shardtrain.model.transformer import Transformer, init_parameters
from shardtrain.parallel.pipeline.partition import layer_ranges, stage_costs
from shardtrain.parallel.pipeline.schedules import Placement, placement


class PipelineStage(nn.Module):
    def __init__(self, model: Transformer, ranges: list[range], *, stage: int,
                 place: Placement, seq_shards: int):
        """`ranges`: the layers of each local chunk; `place`: the virtual stages' placement;
        `seq_shards`: how many ways the activations between stages are split along the
        sequence (tp under sp, else 1)."""
        super().__init__()
        cfg = self.cfg = model.cfg
        ends = [place.virtual(stage, c) for c in range(len(ranges))]
        first, last = 0 in ends, place.last in ends
        if first or (last and cfg.table_at_ends):  # a tied head, or the MTP modules
            self.tok_emb = model.tok_emb
        if first and model.pos_emb is not None:
            self.pos_emb = model.pos_emb
        self.layers = nn.ModuleDict({str(i): model.layers[i] for r in ranges for i in r})
        if last:
            self.norm, self.head = model.norm, model.head
            if model.mtp is not None:  # multi-token prediction (model/mtp.py)
                self.mtp = model.mtp
        self.seq_shards = seq_shards
        self.positions: torch.Tensor | None = None  # as Transformer.positions
        if cfg.style == "llama":  # filled in by init_weights, after materialisation
            self.register_buffer("rope_cos", torch.empty(0), persistent=False)
            self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # A plain list: the chunks share this module's parameters, registered above.
        self.chunks = [StageChunk(self, r, first=ends[c] == 0, last=ends[c] == place.last)
                       for c, r in enumerate(ranges)]

    def tie_weights(self) -> None:
        """The last stage's head and embedding copy share one tensor (as in the model)."""
        if self.cfg.tie_embeddings and hasattr(self, "head") and hasattr(self, "tok_emb"):
            self.head.weight = self.tok_emb.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter by its full-model name, as Transformer.init_weights draws it
        (tensor-parallel shards are then overwritten with their slices: tensor/sharding.py)."""
        self.tie_weights()
        init_parameters(self, self.cfg, seed)

    def rope(self, seq_len: int, positions: torch.Tensor | None,
             documents: Documents | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.cfg.style != "llama":
            return None
        at = position_index(self, seq_len, positions, documents)
        return self.rope_cos[at], self.rope_sin[at]


class StageChunk(nn.Module):
    """The layers of one virtual stage, with the embedding before them on the first and the
    final norm and head after them on the last."""

    def __init__(self, stage: PipelineStage, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.__dict__["stage"] = stage  # not a submodule: the stage owns the parameters
        self.indices, self.first, self.last = layers, first, last

    def used_parameters(self) -> list[nn.Parameter]:
        """The stage's parameters this chunk's forward reads (a tied table once per use)."""
        stage = self.stage
        mods = [stage.layers[str(i)] for i in self.indices]
        if self.first:
            mods += [stage.tok_emb, *([stage.pos_emb] if hasattr(stage, "pos_emb") else [])]
        if self.last:
            mods += [stage.norm, stage.head, *([stage.tok_emb, stage.mtp]
                                               if hasattr(stage, "mtp") else [])]
        return list({id(p): p for m in mods for p in m.parameters()}.values())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *,
                mtp_tokens: torch.Tensor | None = None) -> torch.Tensor | MTPOutput:
        """`positions` [B, S]: packed documents (model/positions.py); every chunk takes
        them, as every chunk's attention masks by document. `mtp_tokens` [B, S, D]: the
        last chunk's multi-token prediction depths' input tokens (model/mtp.py)."""
        stage = self.stage
        documents = None if positions is None else Documents.from_positions(positions)
        if self.first:  # x: tokens [B, S]
            seq_len = x.shape[1]
            x = stage.tok_emb(x)  # [B, S, C]
            if hasattr(stage, "pos_emb"):
                x = x + stage.pos_emb(position_ids(stage, seq_len, positions, x.device,
                                                   documents))
        else:  # x: activations [B, S / seq_shards, C]
            seq_len = x.shape[1] * stage.seq_shards
        rope = stage.rope(seq_len, positions, documents)
        for i in self.indices:
            x = stage.layers[str(i)](x, rope, documents)
        if self.last:
            h, x = x, stage.head(stage.norm(x))  # [B, S, V] (or [B, S, V/tp])
            if hasattr(stage, "mtp") and stage.training:
                return mtp_forward(stage, h, mtp_tokens, x, rope, documents)
        return x


def split_stages(model: Transformer, cfg: Config, stage: int) -> tuple[nn.Module, list[nn.Module]]:
    """(the module whose parameters this rank holds, its chunks in local order). Without
    pipeline parallelism that is the model itself, its one chunk. Layers are balanced by
    FLOPs over the stages (partition.py)."""
    p = cfg.parallel
    if p.pp == 1:
        return model, [model]
    costs = stage_costs(cfg.model, by="flops", seq_len=cfg.train.seq_len)
    place = placement(p.schedule, p.pp, p.virtual_stages)
    ranges = layer_ranges(cfg.model.n_layers, p.pp, p.virtual_stages, shape=place.shape,
                          costs=costs)[stage]
    module = PipelineStage(model, ranges, stage=stage, place=place,
                           seq_shards=p.tp if p.sp else 1)
    return module, module.chunks
