"""Run one rank's part of any valid pipeline schedule, and record its timeline.

The executor knows nothing about transformers: it drives a list of chunk modules (which
virtual stage local chunk c is: the placement, schedules.Placement) and, on the last virtual
stage, a loss function. Virtual stage 0 takes the micro-batch's inputs; every other chunk
takes an activation received from the previous virtual stage. All boundary activations share
one shape and dtype, known in advance ([micro_batch, seq_len / seq_shards, dim] for the
transformer), so receives are posted into preallocated buffers with no shape handshake. They
travel, with their gradients, in the wire dtype (the precision policy's boundary dtype: the
compute dtype, half the bytes of the fp32 residual stream under bf16) and are upcast on
arrival, so every chunk computes on the residual stream's dtype.

Transfers go through the pipeline communicator (so the ledger counts them): consecutive
transfer actions are posted as one batch and waited for together, the semantics the
validator proved deadlock-free (under the V placement and ZB-H1 sends are eager: posted,
then collected once done or at the end of the run; a hand-off between two chunks of this
rank is no transfer). Gradients accumulate over the micro-batches; the caller's `no_sync`
context suppresses gradient communication on every backward except each chunk's last, so a
data-parallel reducer all-reduces once, overlapping the remaining backwards. A (micro-batch,
chunk) with a W in the schedule has its backward split (split_backward.py): its B computes
the input gradient only, its W the weights' gradients -- then a chunk's last W is what
communicates. Where the W is the action right after its B, B runs the whole backward instead
and the W is an empty slot (`split_keys`).

Timeline format (`PipelineExecutor.timeline`, written by the trainer as
`<run_dir>/timeline_rank{R}.json`; read by `shardtrain report`; keep it stable):

    {"rank": r, "stage": s, "pp": p, "microbatches": m, "virtual_stages": v,
     "schedule": "1f1b", "step": k,
     "actions": [{"op": "F"|"B"|"W"|"send_act"|"recv_act"|"send_grad"|"recv_grad",
                  "mb": i, "chunk": c, "start": t0, "end": t1}, ...]}

`rank` is the global rank, `stage` the pipeline stage, `chunk` the local chunk index, `step`
the optimizer step (added by the trainer; `schedule` comes from the caller; under context
parallelism the pipeline adds `attention_s`, this rank's attention compute seconds); times
are seconds from the origin the pipeline group agreed once, right after a barrier at its
first training step (so stages share a time origin up to that barrier's skew, and no step
pays a barrier: the schedule's transfers already order the stages; a forward-only evaluation
before any training step times from its own start, its timeline is not kept). A step's span
is from its first forward to its last action (train/observe/report.py). Transfers of one
batch share its start (posting) and end (all complete). On CPU the clock is
time.perf_counter(); on CUDA each mark is an event recorded on the current stream (`Clock`),
so the times are the GPU's, not those of the kernel launches, and the actions' times are
filled in by `settle()` (the strategy calls it after the step's agreed decision, when every
mark has passed: no wait).

The micro-batches' host tensors reach the device through `Feed`, pinned and one ahead: a
`.to(device)` from pageable memory would block the host until the device reached the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.parallel.pipeline.clock import Clock
from shardtrain.parallel.pipeline.feed import Feed
from shardtrain.parallel.pipeline.schedules import COMPUTE, Action, Placement
from shardtrain.parallel.pipeline.split_backward import (Kept, input_backward, split_keys,
                                                         weight_backward)
from shardtrain.model.moe import loss_grad_scale

# (output, targets) -> mean; or (objective, reported [P]): multi-token prediction's loss
# (model/mtp.py MTPLoss) backpropagates the objective and reports its parts.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


class PipelineExecutor:
    def __init__(self, chunks: Sequence[nn.Module], comm: Communicator, *, loss: LossFn,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype, device: torch.device,
                 wire_dtype: torch.dtype | None = None,
                 autocast: AbstractContextManager | None = None, rank: int = 0,
                 place: Placement | None = None):
        """`comm`: the pipeline group (group rank = stage); `act_shape`/`act_dtype`: the
        boundary activation of one micro-batch; `wire_dtype`: what it and its gradient
        travel in (default act_dtype); `autocast`: entered around each forward; `rank`:
        the global rank, for the timeline; `place`: the virtual stages' placement (default:
        the loop over len(chunks) chunks)."""
        self.chunks, self.comm, self.loss = list(chunks), comm, loss
        self.stage, self.pp = comm.rank, comm.size
        self.place = place or Placement(comm.size, len(self.chunks))
        self.act_shape, self.act_dtype, self.device = act_shape, act_dtype, device
        self.wire_dtype = wire_dtype or act_dtype
        self.autocast = autocast or nullcontext()
        self.rank = rank
        self.timeline: dict[str, Any] | None = None
        self.peak_live = 0  # most micro-batches' activations held at once in the last run
        self.origin: float | torch.cuda.Event | None = None  # agreed at the first training run
        self._unsettled: _Run | None = None  # CUDA: the run whose action times are not read

    @property
    def virtual_stages(self) -> int:
        return len(self.chunks)

    def run(self, actions: list[Action], inputs: Sequence[torch.Tensor],
            targets: Sequence[torch.Tensor], *, backward: bool = True,
            no_sync: Callable[[], AbstractContextManager] | None = None,
            loss_scale: float = 1.0, info: dict[str, Any] | None = None,
            positions: Sequence[torch.Tensor] | None = None,
            weights: Sequence[float] | None = None, parts: int = 0,
            mtp_tokens: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Run this rank's `actions` over m micro-batches: `inputs` and `targets` hold m
        each (inputs are read on virtual stage 0, targets on the last); `positions`, m
        more, go to every chunk (packed documents: model/positions.py). Returns the sum
        over micro-batches of their mean loss times their weight (`weights`, default 1:
        pipeline/runtime.py says why a micro-batch weighs more or less) on the rank holding
        the last virtual stage (zero elsewhere). With `backward`, each micro-batch's loss
        is scaled by loss_scale x weight / m before its backward, so the accumulated
        gradients are loss_scale times those of the weighted mean loss (loss_scale: fp16's
        loss scaling, else 1). `info`: extra timeline fields (the schedule's name). `parts`:
        the loss reports that many values (LossFn), each summed so: the result is [parts].
        `mtp_tokens`: m more, read by the last virtual stage (multi-token prediction)."""
        m = len(inputs)
        self.settle()  # the last run's marks have passed (its step was decided)
        if backward and self.origin is None:  # once: the stages' shared time origin
            self.comm.barrier()
            self.origin = Clock.stamp(self.device.type == "cuda")
        run = _Run(self, m, backward, loss_scale)
        if parts:
            run.loss_sum = torch.zeros(parts, device=self.device)
        run.feed = Feed(self.device, inputs=inputs, targets=targets, positions=positions,
                        mtp_tokens=mtp_tokens)
        run.weights = weights
        run.split = split_keys(actions)
        # per chunk, the last action that accumulates weight gradients
        final = {a.chunk: a for a in actions
                 if a.op in ("B", "W") and (a.op == "W") == ((a.mb, a.chunk) in run.split)}
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.op in COMPUTE:
                start = run.clock.mark()
                if a.op == "F":
                    run.forward(a)
                else:
                    last = final[a.chunk] == a
                    with nullcontext() if last or no_sync is None else no_sync():
                        run.backward(a) if a.op == "B" else run.weight(a)
                run.record([a], start)
                i += 1
                continue
            j = i
            while j < len(actions) and actions[j].op not in COMPUTE:
                j += 1
            start = run.clock.mark()
            run.transfer(actions[i:j])
            run.record(actions[i:j], start)
            i = j
        for work in run.sending:  # eager sends: their receivers have taken them by now
            work.wait()
        self.peak_live = run.peak_live
        self.timeline = {"rank": self.rank, "stage": self.stage, "pp": self.pp,
                         "microbatches": m, "virtual_stages": self.virtual_stages, **(info or {})}
        self._unsettled = run
        if not run.clock.cuda:
            self.settle()
        return run.loss_sum

    def settle(self) -> dict[str, Any] | None:
        """The last run's timeline with its actions' times ("actions"). On CUDA their marks
        are read here, once the step's work has passed them (module doc)."""
        if self._unsettled is not None:
            self.timeline["actions"] = self._unsettled.events()
            self._unsettled = None
        return self.timeline

    def _virtual(self, chunk: int) -> int:
        return self.place.virtual(self.stage, chunk)

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int]:
        """(stage, local chunk) of the virtual stage `step` (+1 or -1) from this chunk's."""
        return self.place.where(self._virtual(chunk) + step)


class _Run:
    """The state of one executor run: saved activations, buffers in flight, the timeline."""

    def __init__(self, ex: PipelineExecutor, m: int, backward: bool, loss_scale: float):
        self.ex, self.m, self.backward_pass, self.loss_scale = ex, m, backward, loss_scale
        self.last_virtual = ex.pp * ex.virtual_stages - 1
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, chunk)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.split: set[tuple[int, int]] = set()  # (mb, chunk)s whose W is its own action
        # what a split B leaves for its W: the split's state, or (output, its gradient) for
        # virtual stage 0, whose input gradient nobody needs: its W is the whole backward
        self.kept: dict[tuple[int, int], Kept | tuple] = {}
        self.outgoing: dict[tuple[str, int, int], torch.Tensor] = {}
        self.sending: list = []  # eager sends' works (PeerWork) not yet collected
        self.loss_sum = torch.zeros((), device=ex.device)
        self.clock = Clock(ex.device, ex.origin)
        self.spans: list[tuple[Action, int, int]] = []  # (action, start mark, end mark)
        self.peak_live = 0
        self.feed: Feed | None = None  # the micro-batches' inputs, targets, positions
        self.weights: Sequence[float] | None = None  # per micro-batch; None: all 1

    def forward(self, a: Action) -> None:
        ex, g = self.ex, self.ex._virtual(a.chunk)
        if g == 0:
            x = self.feed.take("inputs", a.mb)
        else:
            x = self._incoming("act", a.mb, a.chunk, -1).to(ex.act_dtype)  # upcast
            x.requires_grad_(self.backward_pass)
        # The MoE auxiliary losses' gradients are scaled as this loss's is (model/moe.py).
        extra = (self.feed.take("positions", a.mb),) if self.feed.has("positions") else ()
        tokens = {"mtp_tokens": self.feed.take("mtp_tokens", a.mb)} \
            if g == self.last_virtual and self.feed.has("mtp_tokens") else {}
        with ex.autocast, loss_grad_scale(self.loss_scale / self.m):
            out = ex.chunks[a.chunk](x, *extra, **tokens)
        if g == self.last_virtual:
            loss = ex.loss(out, self.feed.take("targets", a.mb))
            loss, reported = loss if isinstance(loss, tuple) else (loss, loss)
            # A weight of exactly 1 (every token counted) leaves both products unchanged.
            w = 1.0 if self.weights is None else self.weights[a.mb]
            self.loss_sum += reported.detach() * w
            out = loss * (self.loss_scale * w / self.m)
        else:
            if out.shape != ex.act_shape or out.dtype != ex.act_dtype:
                raise RuntimeError(
                    f"stage {ex.stage} chunk {a.chunk} produced {tuple(out.shape)} "
                    f"{out.dtype}, but the pipeline's boundary activations are "
                    f"{ex.act_shape} {ex.act_dtype}")
            self.outgoing[("act", a.mb, a.chunk)] = out.detach().to(ex.wire_dtype)
        if self.backward_pass:
            self.saved[(a.mb, a.chunk)] = (x, out)
            self.peak_live = max(self.peak_live, len(self.saved))

    def backward(self, a: Action) -> None:
        key, g = (a.mb, a.chunk), self.ex._virtual(a.chunk)
        x, out = self.saved[key] if key in self.split else self.saved.pop(key)
        # None: out is this micro-batch's loss x loss_scale / m
        grad = None if g == self.last_virtual else \
            self._incoming("grad", a.mb, a.chunk, +1).to(out.dtype)
        if key not in self.split:
            out.backward(grad)
        elif g == 0:
            self.kept[key] = (out, grad)
        else:
            self.kept[key] = input_backward(out, grad, x)
        if g > 0:
            self.outgoing[("grad", a.mb, a.chunk)] = x.grad.to(self.ex.wire_dtype)

    def _incoming(self, kind: str, mb: int, chunk: int, step: int) -> torch.Tensor:
        """The input activation (step -1) or output gradient (+1): received, or handed
        over by the neighbouring virtual stage's chunk on this rank (the V's turn)."""
        stage, other = self.ex._neighbour(chunk, step)
        if stage != self.ex.stage:
            return self.received.pop((kind, mb, chunk))
        return self.outgoing.pop((kind, mb, other))

    def weight(self, a: Action) -> None:
        """W: the weight gradients of a split backward; then its activations go. (A W
        that its B ran whole, split_keys, has nothing left to do.)"""
        if (a.mb, a.chunk) not in self.split:
            return
        kept = self.kept.pop((a.mb, a.chunk))
        if isinstance(kept, Kept):
            weight_backward(kept)
        else:
            kept[0].backward(kept[1])
        del self.saved[(a.mb, a.chunk)]

    def transfer(self, batch: list[Action]) -> None:
        """Post the batch's sends and receives together; return when all are done."""
        ex = self.ex
        sends, recvs = [], []
        for a in batch:
            kind = "act" if a.op.endswith("act") else "grad"
            # activations go to the next virtual stage, gradients to the previous one
            ahead = (kind == "act") == a.op.startswith("send")
            peer = ex._neighbour(a.chunk, 1 if ahead else -1)[0]
            if a.op.startswith("send"):
                sends.append((peer, self.outgoing.pop((kind, a.mb, a.chunk)), f"pp_{kind}"))
            else:
                buffer = torch.empty(ex.act_shape, dtype=ex.wire_dtype, device=ex.device)
                self.received[(kind, a.mb, a.chunk)] = buffer
                recvs.append((peer, buffer, f"pp_{kind}"))
        if ex.place.eager_sends:  # the tensors stay alive in the works until taken
            for work in [w for w in self.sending if w.done()]:
                work.wait()  # done: returns at once (or raises what the send met)
                self.sending.remove(work)
            self.sending += [ex.comm.isend(t.contiguous(), peer, tag=tag)
                             for peer, t, tag in sends]
            sends = []
        if sends or recvs:
            ex.comm.exchange(sends, recvs)

    def record(self, actions: list[Action], start: int) -> None:
        end = self.clock.mark()
        self.spans += [(a, start, end) for a in actions]

    def events(self) -> list[dict[str, Any]]:
        """The timeline's actions, in seconds from the origin."""
        t = self.clock.seconds()
        return [{"op": a.op, "mb": a.mb, "chunk": a.chunk, "start": t[start], "end": t[end]}
                for a, start, end in self.spans]
