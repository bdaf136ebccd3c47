"""The pipeline as the trainer's step sees it: micro-batches in, the mean loss out.

`Pipeline` builds the configured schedule and the forward-only evaluation schedule once,
proves both sound (validate.py) before anything runs, and drives the executor. Without
pipeline parallelism the same path runs: one stage, one chunk (the model), and the 1F1B
schedule degenerates to forward, backward, forward, backward, ... -- gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from shardtrain.config import Config
from shardtrain.config.data import IGNORE
from shardtrain.config.replicas import data_parallel
from shardtrain.mesh import ParallelMesh
from shardtrain.model.mtp import depth_batch
from shardtrain.model.positions import Documents
from shardtrain.parallel.context.apply import context_cores
from shardtrain.parallel.context.balance import balanced
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.pipeline import pipedream, schedules
from shardtrain.parallel.pipeline.executor import LossFn, PipelineExecutor
from shardtrain.parallel.pipeline.pipedream import WeightVersions
from shardtrain.parallel.pipeline.validate import validate
from shardtrain.parallel.precision import PrecisionPolicy

# (inputs, targets), each [micro_batch, seq_len]; packed documents add positions, the same
# shape (model/positions.py). Targets of IGNORE are not trained on (chat's prompts).
Batch = tuple[torch.Tensor, ...]


class Pipeline:
    def __init__(self, chunks: Sequence[nn.Module], mesh: ParallelMesh, cfg: Config, *,
                 loss: LossFn, device: torch.device, policy: PrecisionPolicy,
                 split: SequenceSplit | None = None):
        """`split`: context parallelism's split of each sequence; this rank then runs its
        slice of every micro-batch (tokens and targets alike), and the mean loss is
        averaged over the replica group dp x cp (every cp rank holds as many tokens)."""
        p, t = cfg.parallel, cfg.train
        self.pp, self.dp = mesh.comm("pp"), mesh.comm("dp")
        self.replicas = mesh.comm(mesh.replica_dim)
        self.split, self.cp_rank = split, mesh.comm("cp").rank
        self.m = t.accumulation_steps(data_parallel(cfg, self.dp.size))  # dp over groups
        v = p.virtual_stages
        # PipeDream-2BW: each step's micro-batches on the stashed version (pipedream.py)
        self.versions = WeightVersions(chunks) if p.schedule == pipedream.NAME else None
        executed = pipedream.EXECUTED if self.versions else p.schedule
        self.schedule = executed  # what the timeline names: the order each step ran in
        self.place = schedules.placement(executed, self.pp.size, v)
        plan = schedules.build(executed, self.pp.size, self.m, v)
        validate(plan, self.pp.size, self.m, v, shape=self.place.shape,
                 eager=self.place.eager_sends,
                 bound=schedules.activation_bound(executed, self.pp.size, self.m, v))
        evaluation = schedules.build_forward_only(self.pp.size, 1, v, self.place.shape)
        validate(evaluation, self.pp.size, 1, v, backward=False, shape=self.place.shape,
                 eager=self.place.eager_sends)
        self.actions, self.eval_actions = plan[self.pp.rank], evaluation[self.pp.rank]
        # context and sequence parallel: the activations between stages are split
        seq = t.seq_len // p.cp // (p.tp if p.sp else 1)
        self.executor = PipelineExecutor(
            chunks, self.pp, loss=loss, act_shape=(t.micro_batch, seq, cfg.model.dim),
            act_dtype=policy.residual_dtype, wire_dtype=policy.boundary_dtype, device=device,
            autocast=policy.autocast(device), rank=mesh.rank, place=self.place)
        # Multi-token prediction reports the main loss and each depth's (model/mtp.py).
        self.depth = cfg.model.mtp_depth
        self.parts = 1 + self.depth if self.depth else 0
        # The last training step's timeline (format: executor.py) and the most micro-batches
        # whose activations this rank held at once during it.
        self.timeline: dict[str, Any] | None = None
        self.peak_live = 0
        # Context parallelism: this rank's attention compute time goes into the timeline
        # (`attention_s`), where the load balance of the sequence split shows.
        self.cores = [c for chunk in chunks for c in context_cores(chunk)]

    def train(self, micro_batches: list[Batch],
              no_sync: Callable[[], AbstractContextManager],
              loss_scale: float = 1.0, loss_tokens: int | None = None, groups: int = 1
              ) -> torch.Tensor:
        """Forward and backward of this replica's m micro-batches, gradients accumulated
        (`no_sync` silences gradient communication but on each chunk's last backward) and
        multiplied by `loss_scale` (fp16). `loss_tokens`: the counted targets (not IGNORE)
        of the whole global batch, every replica's micro-batches (the sampler counts them:
        data/sampler.py); None: every target counts. `groups`: the live replica groups
        sharing that batch (parallel/replica/sync.py). Returns the mean loss over those
        tokens (unscaled), the same on every stage; with multi-token prediction [1 + D]:
        the main loss, then each depth's."""
        mine = [self._mine(b) for b in micro_batches]
        batches, mtp_tokens = [b for b, _ in mine], [t for _, t in mine] if self.depth else None
        inputs, targets = [b[0] for b in batches], [b[1] for b in batches]
        positions = [b[2] for b in batches] if len(batches[0]) > 2 else None
        weights = None if loss_tokens is None else self._weights(targets, loss_tokens, groups)
        with self.versions.computing() if self.versions else nullcontext():
            total = self.executor.run(self.actions, inputs, targets, no_sync=no_sync,
                                      loss_scale=loss_scale, info={"schedule": self.schedule},
                                      positions=positions, weights=weights,
                                      parts=self.parts, mtp_tokens=mtp_tokens)
        self.timeline, self.peak_live = self.executor.timeline, self.executor.peak_live
        if self.cores:
            self.timeline["attention_s"] = sum(core.compute_s for core in self.cores)
            for core in self.cores:
                core.reset()
        return self._from_last_stage(total / self.m)

    def _weights(self, targets: list[torch.Tensor], loss_tokens: int, groups: int
                 ) -> list[float]:
        """Each micro-batch's weight. Its loss is the mean over its own counted tokens, but
        the step's loss must be the sum of per-token losses over the global batch's count
        -- the same number whatever the layout, not a mean of means, which would weigh a
        token of a micro-batch with few counted tokens more. Micro-batch i, with n_i of
        them here, weighs n_i x R x m / loss_tokens: the executor divides by the m
        micro-batches and the replicas' gradients are averaged over R (dp, x cp), so the
        step's gradient is that of sum(token losses) / loss_tokens. With every token
        counted, n_i = loss_tokens / (R m): every weight is exactly 1. A global batch with
        no counted token weighs nothing. Replica groups multiply R by the live groups,
        whose gradients are averaged too."""
        scale = self.replicas.size * groups * self.m
        return [int(main_targets(t).ne(IGNORE).sum()) * scale / loss_tokens if loss_tokens
                else 0.0 for t in targets]

    def evaluate(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """The mean loss over the counted tokens of one batch (forward only), the same on
        every stage, and the share of this rank's targets that count (the weight of this
        loss in an average over batches and ranks: exactly 1 when all do)."""
        (inputs, targets, *positions), _ = self._mine(batch)  # evaluation: no MTP forward
        total = self.executor.run(self.eval_actions, [inputs], [targets], backward=False,
                                  positions=[positions[0]] if positions else None)
        main = main_targets(targets)
        return self._from_last_stage(total), int(main.ne(IGNORE).sum()) / main.numel()

    def average_over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        self.replicas.all_reduce(loss, "avg", tag="metric")
        return loss

    def _mine(self, batch: Batch) -> tuple[Batch, torch.Tensor | None]:
        """This cp rank's slice of every sequence of a micro-batch (all of it without cp).
        Packed documents' positions (batch[2]) stay whole: each rank's attention needs the
        documents' spans over the full rows, and RoPE takes the positions held from them
        (model/positions.py, `position_index`). With multi-token prediction the depths'
        input tokens [B, S, D] (returned beside the batch) and targets [B, S, 1 + D] (in
        the targets' place) are built from the whole rows first (model/mtp.py
        `depth_batch`): a rank's last tokens' are in the next rank's slice."""
        inputs, targets, *positions = batch
        extra = None
        if self.depth:
            extra, targets = depth_batch(inputs, targets, positions[0] if positions else None,
                                         self.depth)
        if self.split is None:
            return (inputs, targets, *positions), extra
        split = self.split if not positions else \
            balanced(self.split, Documents.from_positions(positions[0]))
        mine = [split.take(t, self.cp_rank, dim=1) for t in (inputs, targets)]
        return (*mine, *positions), None if extra is None else \
            split.take(extra, self.cp_rank, dim=1)

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        """From the stage holding the last virtual stage (stage 0 under the V)."""
        self.pp.broadcast(loss, src=self.place.where(self.place.last)[0], tag="metric")
        return loss


def main_targets(targets: torch.Tensor) -> torch.Tensor:
    """The next-token targets [B, S] of a micro-batch's targets: with multi-token
    prediction [B, S, 1 + D] (`Pipeline._mine`), their first column."""
    return targets[..., 0] if targets.dim() == 3 else targets
