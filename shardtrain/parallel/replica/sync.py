"""What crosses the replica groups, per parallel.sync, on any CrossReplica (docs/faults.md
"Replica groups").

every_step  the gradients the optimizer reads (view.py), averaged over the live groups
            after the inner sync and before clipping, so the norm, the clip and the skip
            decision are the same in every group: R groups equal dp over every rank.
local_sgd   no gradient crosses; every sync_every = H steps, after the optimizer step, the
            weights the optimizer updates are averaged (Lin et al. 2018, "Don't Use Large
            Mini-Batches, Use Local SGD", arXiv 1808.07217) and the compute copies refreshed.
diloco      every H steps the pseudo-gradient outer - mean(local) drives an outer SGD with
            Nesterov momentum on the weights at the last sync (the outer copy: this rank's
            shard, fp32), and the weights become the new outer copy (Douillard et al. 2023,
            arXiv 2311.08105). The outer copy and its momentum are checkpointed.

sync_fragments = F (streaming DiLoCo / LocalSGD, Douillard et al. 2025, arXiv 2501.18512):
the optimizer's tensors, in their order and concatenated, are cut into F runs of equal
length (+-1 element); fragment k is synchronised after the steps where
step % H == k * H / F, so each sync moves 1/F of the model and the whole model crosses once
every H steps. With F = 1 that is every H-th step.

The per-step loss (and the eval loss) are averaged over the live groups for the record.
The micro-batch weights (pipeline/runtime.py) count the live groups' targets, so a group's
gradient is its tokens' loss sum over the live groups' total count, times the live groups:
their average is exactly the dp gradient of the step's batch (masks included), and with
every target counted it is each group's own mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from shardtrain.ckpt.files import Piece, Reader
from shardtrain.parallel.replica import CrossReplica
from shardtrain.parallel.replica.view import ReplicaView


def fragments(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """`tensors` (in order, flattened and concatenated) cut into `n` runs of equal length
    (run k is [k total // n, (k + 1) total // n): lengths differ by at most one): per
    run, 1-D views of the tensors it covers."""
    total = sum(t.numel() for t in tensors)
    bounds = [total * k // n for k in range(n + 1)]
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    start = 0
    for t in tensors:
        flat, end = t.view(-1), start + t.numel()
        for k in range(n):
            a, b = max(start, bounds[k]), min(end, bounds[k + 1])
            if a < b:
                out[k].append(flat[a - start:b - start])
        start = end
    return out


def average(cross: CrossReplica, tensors: list[torch.Tensor], tag: str,
            bucket_bytes: float) -> None:
    """In place, the mean over the live groups: consecutive tensors of one dtype packed into
    buckets of about `bucket_bytes` (one call each; a tensor alone is sent as it is)."""
    bucket: list[torch.Tensor] = []
    size = 0.0
    for t in [*tensors, None]:
        if bucket and (t is None or size >= bucket_bytes or t.dtype != bucket[0].dtype):
            if len(bucket) == 1:
                cross.all_reduce(bucket, "avg", tag=tag)
            else:
                flat = torch.cat([b.reshape(-1) for b in bucket])  # [sum of numels]
                cross.all_reduce([flat], "avg", tag=tag)
                torch._foreach_copy_(bucket, [v.view_as(b) for v, b in zip(
                    flat.split([b.numel() for b in bucket]), bucket)])
            bucket, size = [], 0.0
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()


class ReplicaSync:
    """parallel.sync over `cross` for one update half (its ReplicaView)."""

    def __init__(self, cfg: Any, cross: CrossReplica, view: ReplicaView):
        p = cfg.parallel
        self.cross, self.view, self.mode = cross, view, p.sync
        self.every, self.n = p.sync_every, p.sync_fragments
        self.lr, self.momentum = p.outer_lr, p.outer_momentum
        self.bucket_bytes = cfg.comm.bucket_mb * 2**20
        self.step = 0  # the step being taken (1-based), set at its start (train/replicas.py)
        self.parts = fragments(view.weights, self.n) if self.mode != "every_step" else []
        # diloco: per fragment, the outer copy of the weights and the outer momentum, both
        # laid out like the weights (so checkpointed as their pieces are).
        self.outer: list[torch.Tensor] = []
        self.buf: list[torch.Tensor] = []
        if self.mode == "diloco":
            self.outer = [w.detach().to(torch.float32, copy=True) for w in view.weights]
            self.buf = [torch.zeros_like(o) for o in self.outer]
            self.outer_parts = fragments(self.outer, self.n)
            self.buf_parts = fragments(self.buf, self.n)

    @property
    def live(self) -> int:
        return self.cross.live

    def gradients(self) -> None:
        """After the inner gradient sync, before clipping."""
        if self.mode == "every_step":
            average(self.cross, self.view.grads(), "rep:grad", self.bucket_bytes)

    def metric(self, value: torch.Tensor) -> torch.Tensor:
        """A per-group mean (the loss) as the live groups' mean, in place."""
        self.cross.all_reduce([value], "avg", tag="rep:metric")
        return value

    def due(self) -> list[int]:
        """The fragments synchronised after this step (module docstring)."""
        if self.mode == "every_step":
            return []
        return [k for k in range(self.n) if self.step % self.every == k * self.every // self.n]

    @torch.no_grad()
    def after_step(self) -> None:
        """local_sgd / diloco: synchronise the due fragments' weights."""
        due = self.due()
        for k in due:
            local = self.parts[k]  # 1-D views of the weights
            if self.mode == "local_sgd":
                average(self.cross, local, "rep:weights", self.bucket_bytes)
                continue
            mean = [t.to(torch.float32, copy=True) for t in local]
            average(self.cross, mean, "rep:weights", self.bucket_bytes)
            outer, buf = self.outer_parts[k], self.buf_parts[k]
            delta = torch._foreach_sub(outer, mean)  # the pseudo-gradient
            # torch.optim.SGD(nesterov=True): buf = mu buf + g; step = g + mu buf
            torch._foreach_mul_(buf, self.momentum)
            torch._foreach_add_(buf, delta)
            torch._foreach_add_(delta, buf, alpha=self.momentum)
            torch._foreach_add_(outer, delta, alpha=-self.lr)
            torch._foreach_copy_(local, outer)
        if due:
            self.view.refresh()

    # ------------------------------------------------------------------ state

    @property
    def prefix(self) -> str:
        """The key prefix of this group's own pieces in a checkpoint every group writes
        (restart mode, `cross.shared_checkpoint`): under local_sgd / diloco the groups'
        weights differ between syncs and their inner optimizer states always, so group
        r > 0 writes its own under "replica<r>/" and group 0 under the plain keys (what a
        run of one group, an export or a sample reads). every_step: the groups are equal,
        one copy. torchft's groups each write their own run directory: plain keys."""
        if self.mode == "every_step" or not self.cross.shared_checkpoint \
                or self.cross.replica == 0:
            return ""
        return f"replica{self.cross.replica}/"

    def own_pieces(self, pieces: list[Piece]) -> list[Piece]:
        """This group's weight and optimizer pieces under its keys (`prefix`)."""
        if not self.prefix:
            return pieces
        return [dataclasses.replace(p, region=dataclasses.replace(
            p.region, key=self.prefix + p.region.key)) for p in pieces]

    @contextlib.contextmanager
    def own_state(self, reader: Reader):
        """While loading: `reader` resolves each plain key to this group's own copy where
        the checkpoint has one (a checkpoint of as many groups), else the plain key: group
        0's state (a checkpoint of fewer groups, or of another sync mode)."""
        if not self.prefix:
            yield
            return
        saved, n = reader.aliases, len(self.prefix)
        own = {k[n:]: k for k in reader.tensors if k.startswith(self.prefix)}
        # a tied alias points at the target's own copy when there is one
        tied = {a: own.get(t, t) for a, t in saved.items()}
        reader.aliases = {**tied, **own}
        try:
            yield
        finally:
            reader.aliases = saved

    @staticmethod
    def _key(state: str):
        return lambda name: f"diloco/{state}/{name}"

    def pieces(self) -> list[Piece]:
        """DiLoCo's outer copy and momentum as checkpoint pieces (none otherwise)."""
        if self.mode != "diloco":
            return []
        return (self.view.pieces(self._key("outer"), self.outer)
                + self.view.pieces(self._key("momentum"), self.buf))

    @torch.no_grad()
    def load(self, reader: Reader) -> None:
        """From a checkpoint with DiLoCo state, that state; else (a run started under
        another sync mode) the outer copy restarts at the loaded weights, no momentum."""
        if self.mode != "diloco":
            return
        if not self.view.load(reader, self._key("outer"), self.outer):
            torch._foreach_copy_(self.outer, [w.float() for w in self.view.weights])
            torch._foreach_zero_(self.buf)
        elif not self.view.load(reader, self._key("momentum"), self.buf):
            torch._foreach_zero_(self.buf)
