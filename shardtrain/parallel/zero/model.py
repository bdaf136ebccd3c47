"""ZeRO-1/2/3 over the dp group (Rajbhandari et al. 2020), on flat units (units.py).

What each stage shards (N_d = dp ranks; each rank owns 1/N_d of every unit):
- Stage 1: the fp32 master weights and optimizer state. Gradients accumulate in full flat
  buffers (the parameters' .grad are views into them) and are reduce-scattered once, after
  the last micro-batch's backward; each rank updates its shard; the updated parameters are
  all-gathered after the step. Reduce-scatter + all-gather = one all-reduce: DP's bytes.
- Stage 2: the gradients too. As soon as a unit's gradients are complete in backward, they
  are reduce-scattered asynchronously (units launched strictly in backward order, the same
  on every rank) and the full gradients are dropped: only the fp32 shard stays, from the
  first reduce-scatter of a step until the next step's zero_grad (as FSDP and DeepSpeed free
  gradients between steps, so the forward's activation peak does not meet them). A unit's
  gradients are flattened only once all have arrived: its backward has freed its
  activations by then (a flat buffer attached at its first gradient would instead meet the
  activation peak at the start of backward). With gradient accumulation every micro-batch
  is reduce-scattered into the accumulated shard (as DeepSpeed's stage 2 does): memory
  stays at the shard, and the gradient bytes moved grow with the number of micro-batches.
- Stage 3: the parameters too (gather.py): a unit is all-gathered before its forward
  and again before its backward, and freed after each; the next `prefetch` units are
  gathered while the current one computes; no all-gather after the step. Gradients as
  stage 2. Per step 1.5x DP's bytes: two all-gathers and one reduce-scatter of the model.
Mixed precision (train.precision=bf16): the flat buffers -- the compute copies that are
gathered -- are bf16, gradients are reduced in bf16 and accumulated in fp32 shards, and the
optimizer keeps fp32 master shards. In fp32 the parameter shard is the master weight.
Tensor parallelism composes: the units hold each tp rank's local tensors; clipping sums the
squared norm over dp and tp, and the gradient parts of blocks shared by several tp ranks are
summed over tp on the shards (tensor/sharding.py). World size 1 runs the same code (the collectives
degenerate to copies).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.config import Config
from shardtrain.model.transformer import Transformer
from shardtrain.parallel.zero.offload import build_shard_optimizer
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.zero.optim import ShardOptimizer
from shardtrain.parallel.zero.gather import ParamGatherer
from shardtrain.parallel.zero.units import FlatUnit, UnitComm, build_units, partial_runs


class ZeroReducer:
    """The gradients of the units: .grad views (stage 1) or backward hooks (stages 2, 3)
    that leave each rank with its averaged fp32 gradient shard of every unit."""

    def __init__(self, units: list[FlatUnit], unit_comm: UnitComm, *, stage: int,
                 gatherer: ParamGatherer | None):
        self.units, self.unit_comm, self.stage, self.gatherer = units, unit_comm, stage, gatherer
        self.order = list(reversed(units))  # backward produces the last unit's grads first
        self._next = 0  # index into order of the next unit to launch
        self._inflight: list[tuple[FlatUnit, object, torch.Tensor, torch.Tensor]] = []
        self._unit_of: dict[nn.Parameter, FlatUnit] = {}
        for u in units:
            fp32 = u.flat.dtype == torch.float32
            if stage == 1:  # full gradients accumulate in place; the fp32 shard is a view
                u.grad_flat = torch.zeros_like(u.flat)
                for p, view in zip(u.params, u.param_views(u.grad_flat)):
                    p.grad = view
                u.grad_shard = u.grad_flat[u.shard_slice()] if fp32 else \
                    torch.zeros(u.shard_numel, device=u.flat.device)
            else:  # the shard exists from the step's first reduce-scatter (_complete)
                for p in u.params:
                    self._unit_of[p] = u
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._reset_pending()

    @contextmanager
    def no_sync(self):
        """An accumulation micro-step. Stage 1 communicates nothing in it; stages 2 and 3
        reduce-scatter every micro-batch (see the module doc) and finish its
        reduce-scatters here, so the next micro-batch starts with none in flight."""
        try:
            yield
        finally:
            if self.stage >= 2:
                self._drain()

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_flat is not None:  # stage 1: the shard is a view of it, or is copied
                u.grad_flat.zero_()
            else:
                u.grad_shard = None

    @torch.no_grad()
    def finish(self) -> None:
        """After the last micro-batch: every unit's grad_shard is its dp-averaged shard."""
        if self.stage >= 2:
            self._drain()
            return
        launched = []  # stage 1: every unit at once, in order, then wait
        for u in reversed(self.units):
            out = torch.empty(u.shard_numel, dtype=u.flat.dtype, device=u.flat.device)
            launched.append((u, self.unit_comm.reduce_grads(u, out, u.grad_flat), out))
        for u, handle, out in launched:
            handle.wait()
            u.grad_shard.copy_(out)

    # ------------------------------------------------------------------ stages 2 and 3

    def _on_grad(self, param: nn.Parameter) -> None:
        self._unit_of[param].pending -= 1
        while self._next < len(self.order) and self.order[self._next].pending == 0:
            self._launch()

    @torch.no_grad()
    def _launch(self) -> None:
        """Reduce-scatter the next unit's full gradients (zeros for parameters that got
        none) asynchronously and drop them. One earlier unit's reduce-scatter stays in
        flight (it had this unit's backward to finish in): two units' full gradients at most."""
        u = self.order[self._next]
        self._next += 1
        full = torch.zeros(u.padded, dtype=u.flat.dtype, device=u.flat.device)  # [padded]
        for p, view in zip(u.params, u.param_views(full)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        if self.gatherer is not None:
            self.gatherer.free(u)  # its backward is done
        out = torch.empty(u.shard_numel, dtype=full.dtype, device=full.device)
        handle = self.unit_comm.reduce_grads(u, out, full)
        self._inflight.append((u, handle, out, full))
        while len(self._inflight) > 1:
            self._complete(self._inflight.pop(0))

    def _complete(self, item) -> None:
        u, handle, out, _ = item
        handle.wait()
        if u.grad_shard is None:  # the step's first micro-batch
            u.grad_shard = out.float()
        else:
            u.grad_shard.add_(out)

    def _drain(self) -> None:
        """Launch the units whose gradients never all arrived (unused parameters), in
        order, so every rank issues the same collectives; wait for all."""
        while self._next < len(self.order):
            self._launch()
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._next = 0
        for u in self.units:
            u.pending = len(u.params)

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes held during a step: stage 1 the full buffers (and fp32 shards when
        they are not views of them), stages 2 and 3 the fp32 shards."""
        full = sum(_nbytes(u.grad_flat) for u in self.units if u.grad_flat is not None)
        shards = sum(4 * u.shard_numel for u in self.units
                     if u.grad_flat is None or u.grad_shard._base is not u.grad_flat)
        return full + shards


class ZeroModel:
    """The units, their gradients, the shard optimizer and the parameter updates of one
    model under ZeRO; Parallelized (parallelize.py) drives it."""

    def __init__(self, model: Transformer, comm: Communicator, tp: StageShards, cfg: Config,
                 unit_comm: UnitComm | None = None):
        p = cfg.parallel
        self.stage, self.comm, self.tp, self.cfg = p.zero, comm, tp, cfg
        dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        align = cfg.comm.quant_block if p.zero_quantized_weights else 1  # qwZ blocks
        self.units = build_units(model, dp_size=comm.size, dp_rank=comm.rank, dtype=dtype,
                                 tied=model.cfg.tie_embeddings, align=align)
        self.unit_comm = unit_comm or UnitComm(comm)
        fp32 = dtype == torch.float32
        masters = [u.shard if fp32 else u.shard.float() for u in self.units]
        self.gatherer = None
        if self.stage == 3:
            for u in self.units:  # the shard gets its own storage; the flat buffer goes
                u.shard = u.shard.clone()
            if fp32:
                masters = [u.shard for u in self.units]
            unit_of = {n: u for u in self.units for n in u.names}
            events = [(model, unit_of["tok_emb.weight"])]
            events += [(block, unit_of[f"layers.{i}.attn_norm.weight"])
                       for i, block in enumerate(model.layers)]
            events.append((model.norm, unit_of["norm.weight"]))
            midpoints = {1 + i: block.mlp_norm for i, block in enumerate(model.layers)}
            self.gatherer = ParamGatherer(model, self.units, self.unit_comm,
                                          prefetch=p.zero_prefetch, events=events,
                                          midpoints=midpoints)
        self.reducer = ZeroReducer(self.units, self.unit_comm, stage=self.stage,
                                   gatherer=self.gatherer)
        aliased = fp32
        if p.zero_quantized_weights and self.stage < 3 and fp32:
            # qwZ's post-step gather writes dequantized values over this rank's slice of the
            # flat buffer: the master weights need their own storage to stay exact.
            masters, aliased = [m.clone() for m in masters], False
        self.optimizer: ShardOptimizer = build_shard_optimizer(
            masters, [u.decay_runs() for u in self.units], cfg, aliased=aliased, rank=comm.rank)
        self._partial = [partial_runs(u, tp.placements) for u in self.units]

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def sync_grads(self) -> None:
        if self.stage == 1:  # pipeline (stage 1 only): the tied copies' full gradients
            self.tp.sum_tied_grads()
        self.reducer.finish()
        if any(self._partial):  # tp blocks whose gradient parts sum over tp
            self.tp.sum_partial([(u.grad_shard[a:b], place) for u, runs in
                                 zip(self.units, self._partial) for place, a, b in runs])

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The L2 norm of the full model's gradient, from the fp32 shards; scales them to at
        most `max_norm`. Squares are summed over this rank's shards, a tensor-parallel block
        weighted parts / t as in tensor/sharding.py (a block held by several tp ranks counts once),
        then over dp, tp and pipeline stages (the last stage's copy of a tied embedding is
        counted on the first)."""
        t = self.tp.comm.size
        skip = self.tp.counted_elsewhere
        total = torch.zeros((), device=self.units[0].grad_shard.device)
        for u in self.units:
            g = u.grad_shard
            if t == 1 and not skip:
                total += g.square().sum()
                continue
            for i, a, b in u.shard_runs(lambda i, u=u: u.names[i] not in skip):
                share = self.tp.placement(u.names[i]).parts / t
                total += g[a:b].square().sum() * share
        self.comm.all_reduce(total, "sum", tag="grad_norm")
        self.tp.comm.all_reduce(total, "sum", tag="grad_norm")
        self.tp.pp.all_reduce(total, "sum", tag="grad_norm")
        total = total.sqrt()
        if max_norm < float("inf"):
            scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for u in self.units:
                u.grad_shard.mul_(scale)
        return total

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Update this rank's shards; stages 1 and 2 then all-gather the new parameters."""
        self.optimizer.step([u.grad_shard for u in self.units],
                            [u.shard for u in self.units], lr)
        if self.stage == 3:
            return
        handles = []
        for u in self.units:  # the input must not alias the output: send a copy
            handles.append(self.unit_comm.gather_params(u, u.flat, u.shard.clone(),
                                                        phase="step"))
        for h in handles:
            h.wait()

    # ------------------------------------------------------------------ state

    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This tp rank's parameters (fp32, from the master shards; collective over dp)."""
        out = {}
        for k, u in enumerate(self.units):
            full = torch.empty(u.padded, device=u.shard.device)  # [padded] fp32
            self.comm.all_gather(full, self.optimizer.master(k).float(), tag="state")
            for name, view in zip(u.names, u.param_views(full)):
                out[name] = view.clone()
        return out

    @torch.no_grad()
    def load_local_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the parameters and master weights from this tp rank's tensors."""
        for k, u in enumerate(self.units):
            full = torch.zeros(u.padded, device=u.shard.device)  # [padded] fp32
            for name, view in zip(u.names, u.param_views(full)):
                view.copy_(state[name])
            self.optimizer.master(k).copy_(full[u.shard_slice()])
            u.shard.copy_(full[u.shard_slice()])
            if self.stage < 3:
                u.flat.copy_(full)

    def memory(self) -> dict[str, int]:
        """Model-state bytes this rank holds, from the tensors: parameters (stages 1-2 the
        full flat buffers, stage 3 the shards; units gathered for compute are transient),
        gradients, master weights and optimizer state."""
        if self.stage == 3:
            params = sum(_nbytes(u.shard) for u in self.units)
        else:
            params = sum(_nbytes(u.flat) for u in self.units)
        params += self.unit_comm.held_param_bytes
        return {"params_bytes": params, "grads_bytes": self.reducer.grad_bytes,
                **self.optimizer.memory()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
