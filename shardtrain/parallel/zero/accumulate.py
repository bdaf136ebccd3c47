"""`parallel.zero_accumulate = unsharded`: ZeRO-2 and ZeRO-3 under gradient accumulation
trade memory for communication, as FSDP2's `set_requires_gradient_sync(False)` and
`reshard_after_backward=False` do (PyTorch FSDP, Zhao et al. 2023, describes both ways of
accumulating: with communication, sharded, and without it, unsharded).

`sharded` (the default, reducer.py) reduce-scatters every micro-batch's gradients into the
fp32 shard, and ZeRO-3 gathers every unit twice per micro-batch: m micro-batches move m
times the gradient bytes (ZeRO-3 also 2m times the parameter bytes). `unsharded` keeps
each unit's full fp32 gradient across the step's micro-batches (the parameters' .grad are
views of it, as under ZeRO-1) and reduce-scatters it once, in the last micro-batch's
backward as each unit's gradient completes there, so the reduction still overlaps
backward; each full gradient is freed once its reduce-scatter is done. ZeRO-3 gathers each
unit once per step, at the first micro-batch's forward, and keeps it through the step's
micro-batches (gather.py `StepGatherer`, the pipeline's gatherer); the last backward frees
each unit as its gradient is reduced. Per step the bytes are those of one micro-batch
whatever m: ZeRO-2 reduce-scatter + all-gather (DP's), ZeRO-3 one all-gather and one
reduce-scatter (DP's too; its backward re-gather is gone). The price: the stage's full
fp32 gradient (ZeRO-3: also its gathered parameters) is held through the step, what
`kept` measures and plan/accumulate.py predicts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from shardtrain.parallel.ready import ReadyInOrder
from shardtrain.parallel.zero.gather import ParamGatherer, StepGatherer, UnitGatherer
from shardtrain.parallel.zero.reducer import ZeroReducer
from shardtrain.parallel.zero.units import FlatUnit


class UnshardedReducer(ZeroReducer):
    """ZeroReducer with full gradients kept over the step's micro-batches (module
    docstring): the full buffers of `per_step`, and the backward launches of stages 2 and 3,
    enabled only outside `no_sync` (the step's last backward: pipeline/executor.py)."""

    def __init__(self, units: list[FlatUnit], **kwargs):
        kwargs["per_step"] = True  # the full buffers, .grad views of them
        super().__init__(units, **kwargs)
        self.launcher = ReadyInOrder([u.params for u in self.order], self._launch)
        self.kept = {"kept_grads_bytes": 0, "kept_params_bytes": 0}  # at the last backward
        self.in_backward = 0  # instrument: buckets the last step launched during backward

    def no_sync(self) -> AbstractContextManager:
        """An accumulation micro-step: gradients add into the full buffers, nothing moves."""
        return self.launcher.paused()

    @torch.no_grad()
    def finish(self) -> None:
        self.in_backward = self.launcher.next
        self._drain()  # the units whose gradients never all arrived in the last backward
        self._scale()

    def _launch(self, i: int) -> None:
        if i == 0:  # the step's first reduction: everything kept is still held
            self._measure()
        super()._launch(i)

    def _flat_gradient(self, u: FlatUnit) -> torch.Tensor:
        """u's accumulated full gradient [padded] in the reduce dtype: its buffer itself
        (fp32), or a copy (bf16 on the wire; the buffer goes at once)."""
        if u.grad_flat.dtype == self.reduce_dtype:
            return u.grad_flat
        wire = u.grad_flat.to(self.reduce_dtype)
        u.grad_flat.untyped_storage().resize_(0)
        return wire

    def _complete(self, item) -> None:
        super()._complete(item)
        for u in item[0].units:  # reduced: the full gradient's storage goes (the views stay)
            u.grad_flat.untyped_storage().resize_(0)

    def _measure(self) -> None:
        """What the step keeps, read off the storage held when its first reduction starts:
        every full gradient, and under ZeRO-3 every gathered unit."""
        grads = sum(u.grad_flat.untyped_storage().nbytes() for u in self.units)
        params = sum(u.flat.untyped_storage().nbytes() for u in self.units) \
            if self.stage == 3 else 0
        self.kept = {"kept_grads_bytes": grads, "kept_params_bytes": params}


def build_accumulation(model: nn.Module, units: list[FlatUnit], *, stage: int,
                       pipelined: bool, unsharded: bool, prefetch: int, **reducer_kwargs
                       ) -> tuple[UnitGatherer | None, ZeroReducer]:
    """ZeRO-3's gatherer (None below stage 3) and the reducer of a ZeroModel: once per step
    under a pipeline (model.py, "With pipeline parallelism" in docs/zero.md) and under
    `unsharded` (this module), else per micro-batch (reducer.py, gather.py)."""
    gatherer: UnitGatherer | None = None
    if stage == 3 and (pipelined or unsharded):
        chunks = getattr(model, "chunks", [model])  # the whole model without a pipeline
        gatherer = StepGatherer(units, chunks, prefetch=prefetch)
    elif stage == 3:
        gatherer = ParamGatherer.for_model(model, units, prefetch=prefetch)
    kind = UnshardedReducer if unsharded else ZeroReducer
    return gatherer, kind(units, stage=stage, gatherer=gatherer, per_step=pipelined,
                          **reducer_kwargs)
