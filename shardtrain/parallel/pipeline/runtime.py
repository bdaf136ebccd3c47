"""The pipeline as the trainer's step sees it: micro-batches in, the mean loss out.

`Pipeline` builds the configured schedule and the forward-only evaluation schedule once,
proves both sound (validate.py) before anything runs, and drives the executor. Without
pipeline parallelism the same path runs: one stage, one chunk (the model), and the 1F1B
schedule degenerates to forward, backward, forward, backward, ... -- gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.context.apply import context_cores
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.pipeline import schedules
from shardtrain.parallel.pipeline.executor import LossFn, PipelineExecutor
from shardtrain.parallel.pipeline.validate import validate
from shardtrain.parallel.precision import PrecisionPolicy

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each [micro_batch, seq_len]


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
        self.schedule = p.schedule
        self.m = t.accumulation_steps(self.dp.size)
        v = p.virtual_stages
        plan = schedules.build(p.schedule, self.pp.size, self.m, v)
        validate(plan, self.pp.size, self.m, v)
        evaluation = schedules.build_forward_only(self.pp.size, 1, v)
        validate(evaluation, self.pp.size, 1, v, backward=False)
        self.actions, self.eval_actions = plan[self.pp.rank], evaluation[self.pp.rank]
        # context and sequence parallel: the activations between stages are split
        seq = t.seq_len // p.cp // (p.tp if p.sp else 1)
        self.executor = PipelineExecutor(
            chunks, self.pp, loss=loss, act_shape=(t.micro_batch, seq, cfg.model.dim),
            act_dtype=policy.boundary_dtype, device=device, autocast=policy.autocast(device),
            rank=mesh.rank)
        # The last training step's timeline (format: executor.py) and the most micro-batches
        # whose activations this rank held at once during it.
        self.timeline: dict[str, Any] | None = None
        self.peak_live = 0
        # Context parallelism: this rank's attention compute time goes into the timeline
        # (`attention_s`), where the load balance of the sequence split shows.
        self.cores = [c for chunk in chunks for c in context_cores(chunk)]

    def train(self, micro_batches: list[Batch],
              no_sync: Callable[[], AbstractContextManager],
              loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of this replica's m micro-batches, gradients accumulated
        (`no_sync` silences gradient communication but on each chunk's last backward) and
        multiplied by `loss_scale` (fp16). Returns the mean loss (unscaled), the same on
        every stage."""
        inputs, targets = zip(*(self._mine(b) for b in micro_batches))
        total = self.executor.run(self.actions, inputs, targets, no_sync=no_sync,
                                  loss_scale=loss_scale, info={"schedule": self.schedule})
        self.timeline, self.peak_live = self.executor.timeline, self.executor.peak_live
        if self.cores:
            self.timeline["attention_s"] = sum(core.compute_s for core in self.cores)
            for core in self.cores:
                core.reset()
        return self._from_last_stage(total / self.m)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch (forward only), the same on every stage."""
        inputs, targets = self._mine((inputs, targets))
        total = self.executor.run(self.eval_actions, [inputs], [targets], backward=False)
        return self._from_last_stage(total)

    def average_over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        self.replicas.all_reduce(loss, "avg", tag="metric")
        return loss

    def _mine(self, batch: Batch) -> Batch:
        """This cp rank's slice of every sequence of a micro-batch (all of it without cp)."""
        if self.split is None:
            return batch
        return tuple(self.split.take(x, self.cp_rank, dim=1) for x in batch)

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        self.pp.broadcast(loss, src=self.pp.size - 1, tag="metric")
        return loss
