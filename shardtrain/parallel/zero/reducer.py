"""ZeRO's gradients (Rajbhandari et al. 2020, sec. 5.1-5.2): what leaves each rank with its
fp32 gradient shard of every flat unit (units.py), reduced over the unit's own group (the
replica group; an expert unit's edp group, its average then scaled by the unit's
`grad_scale`, expert/reduce.py says why).

Stage 1: the parameters' .grad are views into full flat buffers; after the last micro-batch
every unit is reduce-scattered at once. Stages 2 and 3: as soon as a unit's gradients are
complete in backward it is reduce-scattered asynchronously (units launched strictly in
backward order, ready.py: reverse forward order, a tied token table's unit last, as its
gradient completes only with the embedding's backward, cost/units.py `launch_order`) and
the full gradients are dropped (consecutive units of at most comm.bucket_mb in all
share one reduce-scatter: buckets.py); the fp32 shard exists from
the step's first reduce-scatter until the next zero_grad (model.py says why). Under
pipeline parallelism (`per_step`) stages 2 and 3 take stage 1's path -- full gradients
accumulated over the step's micro-batches, one reduce-scatter after the last -- and then
drop the full buffers (their storage freed until the next zero_grad): only the fp32
shards are held from the reduce-scatter to the next step (model.py says why). Gradients
accumulate in fp32 and travel in the policy's reduce dtype (precision.py): fp32, or a bf16
copy whose reduced shard is added back in fp32. A ZeRO-3 parameter gathered in 16 bits
(units.py) gets a 16-bit gradient, the same values autocast's fp32 parameter would get
before its cast back: it is taken into the fp32 (or reduce-dtype) flat gradient as it is.
Under offload (stages 2 and 3, `offload_grads`) a reduced shard goes straight into its
host buffer (offload.py), which becomes the unit's grad_shard: no gradient shard is held on
the device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from shardtrain.cost.units import launch_order
from shardtrain.parallel.ready import ReadyInOrder
from shardtrain.parallel.strategy import nbytes
from shardtrain.parallel.zero.buckets import Bucket, make_buckets
from shardtrain.parallel.zero.gather import UnitGatherer
from shardtrain.parallel.zero.units import FlatUnit


def _accumulate_into(view: torch.Tensor):
    """A hook adding a 16-bit parameter's gradient into its fp32 view and dropping it: the
    sum DP's fp32 .grad would hold (autocast's cast back to fp32 of the same values)."""
    def hook(p: torch.Tensor) -> None:
        view.add_(p.grad)
        p.grad = None
    return hook


class ZeroReducer:
    """The gradients of the units: .grad views (stage 1, and every stage with `per_step`)
    or backward hooks (stages 2, 3) that leave each rank with its fp32 gradient shard of
    every unit, reduced over the unit's group (`FlatUnit.comm`). `per_step`: reduce once per
    step, after the last micro-batch (set under pipeline parallelism). `tied`: the model
    ties its token table to its head (its unit is launched last). `bucket_bytes`
    (comm.bucket_mb): consecutive units of at most that many gradient bytes in all are
    reduce-scattered together (buckets.py); 0: one reduce-scatter per unit."""

    def __init__(self, units: list[FlatUnit], *, stage: int,
                 gatherer: UnitGatherer | None, reduce_dtype: torch.dtype = torch.float32,
                 per_step: bool = False, tied: bool = False, bucket_bytes: float = 0.0):
        self.units, self.stage, self.gatherer = units, stage, gatherer
        self.reduce_dtype = reduce_dtype
        self.per_step = per_step or stage == 1
        # the order backward completes them: the last unit's first, a tied table's last
        self.order = [units[i] for i in launch_order([u.names for u in units], tied=tied)]
        self.buckets = make_buckets(self.order, cap_bytes=bucket_bytes,
                                    element_size=reduce_dtype.itemsize)
        self._bucket_of = {u: b for b in self.buckets for u in b.units}
        self._inflight: list[tuple[Bucket, object, torch.Tensor, torch.Tensor]] = []
        self.launcher: ReadyInOrder | None = None
        self._home: dict[FlatUnit, torch.Tensor] = {}  # offloaded gradient shards' buffers
        for u in units:
            if self.per_step:  # full gradients accumulate in place, in the shard's dtype
                u.grad_flat = torch.zeros(u.padded, dtype=u.shard.dtype, device=u.flat.device)
                for p, view in zip(u.params, u.param_views(u.grad_flat)):
                    if p.dtype == view.dtype:
                        p.grad = view
                    else:  # a 16-bit parameter (split unit, units.py): added in as it comes
                        p.register_post_accumulate_grad_hook(_accumulate_into(view))
            if stage == 1:  # the shard is a view, or a copy filled by finish
                u.grad_shard = u.grad_flat[u.shard_slice()] if u.flat.dtype == u.shard.dtype \
                    else torch.zeros(u.shard_numel, dtype=u.shard.dtype, device=u.flat.device)
        if not self.per_step:  # the shard exists from the step's first reduce-scatter (_complete)
            self.launcher = ReadyInOrder([u.params for u in self.order], self._launch)

    def offload_grads(self, homes: list[torch.Tensor]) -> None:
        """Stages 2 and 3 under offload: each unit's reduced gradient shard [shard] fp32
        lives in `homes[i]` (host memory, offload.py `grad_buffer`), units in order."""
        assert self.stage >= 2, "ZeRO-1's shard is a view of its full gradients"
        self._home = dict(zip(self.units, homes, strict=True))

    def _first(self, u: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        """u's gradient shard from its first reduced `shard` of the step: in the parameter
        shard's dtype (fp32; 16-bit under bf16-true and fp16-true) on the device (a view of
        the reduced row when it has that dtype), or in its host buffer."""
        home = self._home.get(u)
        return shard.to(u.shard.dtype) if home is None else home.copy_(shard)

    @contextmanager
    def no_sync(self):
        """An accumulation micro-step. Stage 1 communicates nothing in it; stages 2 and 3
        reduce-scatter every micro-batch (see model.py) and finish its reduce-scatters
        here, so the next micro-batch starts with none in flight."""
        try:
            yield
        finally:
            if not self.per_step:
                self._drain()

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_flat is not None:  # stage 1: the shard is a view of it, or is copied
                storage = u.grad_flat.untyped_storage()  # stages 2, 3: freed by finish
                storage.resize_(u.padded * u.grad_flat.element_size())
                u.grad_flat.zero_()
            if self.stage >= 2:
                u.grad_shard = None

    @torch.no_grad()
    def finish(self) -> None:
        """After the last micro-batch: every unit's grad_shard is its shard of the gradient
        of the batch's mean loss: its group's average, times the group's `grad_scale`."""
        if self.per_step:
            self._reduce_all()
        else:
            self._drain()
        self._scale()

    def _scale(self) -> None:
        """Each unit's reduced shard times its group's `grad_scale` (expert units)."""
        for u in self.units:
            if u.comm.grad_scale != 1.0:
                u.grad_shard.mul_(u.comm.grad_scale)

    def _reduce_all(self) -> None:
        """Every bucket at once, in order, then wait; at most two packed copies exist at
        a time (a bucket alone reduces its unit's buffer itself)."""
        launched: list[tuple[Bucket, object, torch.Tensor]] = []
        for b in self.buckets:
            while not b.alone and sum(not x.alone for x, _, _ in launched) >= 2:
                self._reduced(*launched.pop(0))
            for u in b.units:  # [padded] in the reduce dtype (itself when already so)
                wire = u.grad_flat.to(self.reduce_dtype)
                if not b.alone:
                    b.pack(u, wire)
            wire = wire if b.alone else b.take()
            out = torch.empty(b.numel, dtype=self.reduce_dtype, device=wire.device)
            launched.append((b, b.comm.reduce_grads(out, wire), out))
        for item in launched:
            self._reduced(*item)

    def _reduced(self, b: Bucket, handle, out: torch.Tensor) -> None:
        handle.wait()
        for u, shard in b.shards(out):
            if self.stage == 1:
                u.grad_shard.copy_(shard)
                continue
            u.grad_shard = self._first(u, shard)  # [shard]
            u.grad_flat.untyped_storage().resize_(0)  # the views stay, storage-less

    # ------------------------------------------------------------------ stages 2 and 3

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        """Unit order[i]'s gradients are complete: into its bucket, and once the bucket is
        full, reduce-scatter it (zeros for parameters that got none) asynchronously and
        drop the full gradients. The earlier bucket's reduce-scatter, which had this
        bucket's backward to finish in, is waited for first: one bucket's full gradients
        exist at a time (a vocabulary-sized unit, alone in its bucket, is a model's largest
        tensor), and it is left in flight only if the next bucket is at least as large."""
        u = self.order[i]
        if self.gatherer is not None:  # its backward is done: free the parameters before
            self.gatherer.backward_done(u)  # the flat gradient is allocated (a vocabulary-
            # sized head would otherwise hold parameters, gradients and flat gradient at once)
        b = self._bucket_of[u]
        if u is b.units[0]:
            while self._inflight:
                self._complete(self._inflight.pop(0))
        full = self._flat_gradient(u)  # [padded]
        if not b.alone:
            b.pack(u, full)
            if u is not b.units[-1]:
                return
            full = b.take()  # [size * numel]
        out = torch.empty(b.numel, dtype=full.dtype, device=full.device)
        handle = b.comm.reduce_grads(out, full)
        self._inflight.append((b, handle, out, full))
        k = self.buckets.index(b)
        following = self.buckets[k + 1] if k + 1 < len(self.buckets) else None
        if following is not None and b.numel > following.numel:
            # In flight, this buffer would sit under the next bucket's whole backward: kept
            # only when no larger than that bucket's own (the head's, vocabulary-sized, is not).
            self._complete(self._inflight.pop())

    def _flat_gradient(self, u: FlatUnit) -> torch.Tensor:
        """u's full gradient [padded] in the reduce dtype, taken out of the parameters'
        .grad. A unit that is one parameter filling the whole buffer (an untied embedding,
        vocabulary-sized) hands over its .grad itself: a copy would hold the model's
        largest gradient twice at the moment of the step's peak."""
        grads = [p.grad for p in u.params]
        alone = grads[0] if len(grads) == 1 else None
        if (alone is not None and alone.numel() == u.padded and alone.is_contiguous()
                and alone.dtype == self.reduce_dtype):
            u.params[0].grad = None
            return alone.view(-1)
        full = torch.zeros(u.padded, dtype=self.reduce_dtype, device=u.flat.device)
        for p, view in zip(u.params, u.param_views(full)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        return full

    def _complete(self, item) -> None:
        b, handle, out, _ = item
        handle.wait()
        for u, shard in b.shards(out):
            if u.grad_shard is None:  # the step's first micro-batch
                u.grad_shard = self._first(u, shard)
            else:  # (to the host buffer's device when offloaded)
                u.grad_shard.add_(shard.to(u.grad_shard.device))

    def _drain(self) -> None:
        """Launch the units whose gradients never all arrived (unused parameters), in
        order, so every rank issues the same collectives; wait for all."""
        self.launcher.drain()
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self.launcher.reset()

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes held during a step: stage 1 the full buffers (and fp32 shards when
        they are not views of them), stages 2 and 3 the fp32 shards (a pipeline's full
        buffers, freed between steps, are transient: plan/memory.py counts them as buffers).
        Offloaded shards are in host buffers (offload.py counts them), none on the device."""
        if self.stage >= 2:
            return sum(u.shard.element_size() * u.shard_numel for u in self.units
                       if u not in self._home)
        full = nbytes(*(u.grad_flat for u in self.units))
        shards = sum(u.shard.element_size() * u.shard_numel for u in self.units
                     if u.grad_shard._base is not u.grad_flat)
        return full + shards
