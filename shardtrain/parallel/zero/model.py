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
  stays at the shard, and the gradient bytes moved grow with the number of micro-batches
  (parallel.zero_accumulate = sharded; unsharded reduces once per step: accumulate.py).
- Stage 3: the parameters too (gather.py): a unit is all-gathered before its forward
  and again before its backward, and freed after each; the next `prefetch` units are
  gathered while the current one computes; no all-gather after the step. Gradients as
  stage 2. Per step 1.5x DP's bytes: two all-gathers and one reduce-scatter of the model.
With pipeline parallelism (pp > 1) a stage runs m forwards and m backwards per step,
interleaved by the schedule (1F1B, interleaved virtual chunks). Stages 2 and 3 then keep the
step's traffic at one reduction per step, as torchtitan's FSDP under pipelining does: full
gradients accumulate over the micro-batches and are reduce-scattered once, after the last
backward, then dropped (only the fp32 shards stay until the next step); stage 3 gathers
each unit once, before the stage's first forward of the step (gather.py `StepGatherer`),
and frees it after that reduce-scatter: DP's bytes (docs/zero.md "With pipeline
parallelism" says why).
Precision (precision.py, the policy every layout shares): the flat buffers hold the
parameters in the policy's parameter dtype, fp32, and under bf16 and fp16 the forward runs
under autocast as DP's does, so ZeRO computes DP's numbers; the parameter shard is the
master weight. Stage 3 gathers the parameters autocast rounds anyway in the compute dtype
(units.py: split units), the same numbers in half the bytes. Gradients accumulate in fp32
and travel in the policy's reduce dtype.
Tensor parallelism composes: the units hold each tp rank's local tensors; clipping sums the
squared norm over dp and tp, and the gradient parts of blocks shared by several tp ranks are
summed over tp on the shards (tensor/sharding.py). World size 1 runs the same code.
ZeRO-3's layer partition (layer.py): whole units per rank, broadcast, reduced to owners.
Expert parallelism composes: each rank holds n_experts / ep experts, replicated only over
the edp ranks (dp x cp / ep) holding the same ones, so, as DeepSpeed-MoE (Rajbhandari et al.
2022) does, the experts get units of their own, sharded over edp (their gradients
reduce-scattered, their ZeRO-3 parameters gathered, their state saved over that group),
every other parameter's over the replica group. An expert unit's averaged gradient is then
scaled by 1/ep (expert/reduce.py says why), and clipping sums each unit's squares over
its own group before the ep sum (`clip_grad_norm`); docs/zero.md "With expert parallelism".
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection

import torch
from torch import nn

from shardtrain.ckpt.files import Piece, Reader
from shardtrain.comm import Communicator
from shardtrain.config import Config
from shardtrain.model.hf import assign
from shardtrain.parallel.build import Fill
from shardtrain.parallel.pieces import (local_model_state, local_tensor, model_key, module_pieces,
                                        zero_load, zero_pieces)
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.precision import PrecisionPolicy
from shardtrain.parallel.strategy import nbytes
from shardtrain.parallel.zero.gather import StepGatherer
from shardtrain.parallel.zero.layer import layer_comms
from shardtrain.parallel.zero.offload import build_shard_optimizer
from shardtrain.parallel.zero.optim import ShardOptimizer, moment_names
from shardtrain.parallel.zero.replica import zero_view
from shardtrain.parallel.zero.accumulate import build_accumulation
from shardtrain.parallel.zero.units import UnitComm, build_units, merge_units, partial_runs
from shardtrain.quant.adam8bit import MIN_QUANTIZED_NUMEL
from shardtrain.quant.blockwise import BLOCK as ADAM8BIT_BLOCK


class ZeroModel:
    """The update half of a ZeRO layout (strategy.py): the units, their gradients, the
    shard optimizer and the parameter updates of one model (or pipeline stage).
    Checkpoints hold this rank's master and moment shards as they are (`state_pieces`)."""

    def __init__(self, model: nn.Module, comm: Communicator, shards: StageShards, cfg: Config,
                 policy: PrecisionPolicy, *, unit_comm: UnitComm | None = None,
                 experts: Collection[nn.Parameter] = (), expert_comm: UnitComm | None = None,
                 fill: Fill | None = None, device: torch.device | None = None):
        """`comm`: the replica group, which shards every unit through `unit_comm` (built
        over it when None), except the `experts` (expert parallelism): their units are
        sharded over `expert_comm`'s group, edp. `fill`: writes the initial values (seeded
        or loaded: parallel/build.py) through `write` once the units exist, before the
        master weights copy anything; the trainable parameters may then arrive on the meta
        device, so a ZeRO-3 rank never holds more than its shards (and one tensor being
        drawn). `device`: where the units live (default: the parameters')."""
        p = cfg.parallel
        self.stage, self.comm, self.shards, self.cfg = p.zero, comm, shards, cfg
        # The moments by their torch names (checkpoints' layout-independent form).
        self.moment_names = ("exp_avg", "exp_avg_sq") if cfg.optim.name == "adamw8bit" \
            else moment_names(cfg.optim)
        dtype = policy.param_dtype
        align = cfg.comm.quant_block if p.zero_quantized_weights else 1  # qwZ blocks
        if cfg.optim.name == "adamw8bit":  # the 8-bit moments' blocks (zero/optim8bit.py)
            align = math.lcm(align, ADAM8BIT_BLOCK)
        self.unit_comm = unit_comm or UnitComm(comm)
        self.comms = [self.unit_comm] + ([expert_comm] if experts else [])

        def build(c: UnitComm, **which) -> list:
            return build_units(model, dp_size=c.comm.size, dp_rank=c.comm.rank, dtype=dtype,
                               tied=model.cfg.tie_embeddings, align=align, comm=c,
                               sharded=self.stage == 3, device=device,
                               gather_dtype=policy.gather_dtype,
                               blocks=p.zero_unit_blocks, partition=p.zero_partition,
                               **which)

        self.units = build(self.unit_comm, skip=experts)
        if p.zero_partition == "layer":  # whole units, broadcast from their owners
            self.unit_comm = layer_comms(self.units, comm)
            self.comms = [self.unit_comm]
        if experts:  # their own units, sharded over edp (module docstring)
            self.units = merge_units(self.units, build(expert_comm, only=experts))
        self._unit_of = {n: (u, i) for u in self.units for i, n in enumerate(u.names)}
        if fill is not None:
            fill(self)
        fp32 = dtype == policy.master_dtype  # the parameter shard is its own master
        masters = [u.shard if fp32 else u.shard.to(policy.master_dtype) for u in self.units]
        # ZeRO-3's gatherer and the reducer: once per step under a pipeline (module
        # docstring) and under zero_accumulate = unsharded (accumulate.py).
        self.gatherer, self.reducer = build_accumulation(
            model, self.units, stage=self.stage, pipelined=shards.pp.size > 1,
            unsharded=p.zero_accumulate == "unsharded", prefetch=p.zero_prefetch,
            reduce_dtype=policy.reduce_dtype, tied=model.cfg.tie_embeddings,
            bucket_bytes=cfg.comm.bucket_mb * 2**20)
        aliased = fp32
        if p.zero_quantized_weights and self.stage < 3 and fp32:
            # qwZ's post-step gather writes dequantized values over this rank's slice of the
            # flat buffer: the master weights need their own storage to stay exact.
            masters, aliased = [m.clone() for m in masters], False
        self.optimizer: ShardOptimizer = build_shard_optimizer(
            masters, [u.decay_runs() for u in self.units], cfg, aliased=aliased, rank=comm.rank,
            small=[[(a, b) for i, a, b in u.shard_runs(lambda i, u=u: u.params[i].numel()
                                                       < MIN_QUANTIZED_NUMEL)] for u in self.units])
        # ZeRO-Infinity (offload.py): under ZeRO-3 the offloaded master is the parameter
        # shard; the gatherer stages it onto the device per gather, none stays at rest.
        self.offload_params = self.stage == 3 and p.offload != "none"
        if self.offload_params:
            # A weak reference: the gatherer lives as long as the hooks on the parameters
            # (a cycle through autograd that Python's collector cannot see); the optimizer
            # must go with this model, and its finalizer delete the nvme files.
            index, host = {u: k for k, u in enumerate(self.units)}, weakref.proxy(self.optimizer)
            self.gatherer.fetch_from(lambda u, out: host.fetch(index[u], out))
        if p.offload != "none" and self.stage >= 2:  # gradient shards in host buffers
            self.reducer.offload_grads([*map(self.optimizer.grad_buffer, range(len(self.units)))])
        self._partial = [partial_runs(u, shards.placements) for u in self.units]
        self.no_sync, self.zero_grad = self.reducer.no_sync, self.reducer.zero_grad

    # ------------------------------------------------------------------ initial values

    def wants(self, name: str) -> bool:
        """Whether this rank keeps any of parameter `name` (ZeRO-3: its shards overlap it),
        so a value source can skip drawing or reading the others (parallel/build.py)."""
        at = self._unit_of.get(name)
        return at is None or at[0].holds(at[1])

    def write(self, name: str, value: torch.Tensor) -> None:
        """Parameter `name` (this tp/ep rank's local tensor) into its unit; a tensor outside
        the units (frozen, NF4 bases, buffers) into the module."""
        at = self._unit_of.get(name)
        if at is None:
            assign(self.shards.model, name, value)
        else:
            at[0].write(at[1], value)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def finish(self) -> None:
        if self.reducer.per_step:  # pipeline: the tied copies' full gradients
            self.shards.sum_tied_grads()
        self.reducer.finish()
        if isinstance(self.gatherer, StepGatherer):  # the step's last use of the parameters
            self.gatherer.free_all()
        if any(self._partial):  # tp blocks whose gradient parts sum over tp
            self.shards.sum_partial([(u.grad_shard[a:b], place) for u, runs in
                                 zip(self.units, self._partial) for place, a, b in runs])

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, unscale: float = 1.0) -> torch.Tensor:
        """The L2 norm of the full model's gradient, from the fp32 shards (first multiplied by
        `unscale`); scales them to at most `max_norm`. Squares are summed over this rank's
        shards, each weighted by `norm_share` (tensor/sharding.py: a block held by several tp
        or ep ranks counts once), then over each unit's group (the replica group; edp for
        the experts), then over tp, ep and pipeline stages (the last stage's copy of a tied
        embedding is counted on the first). A dense parameter's shards thus add up to its
        whole square on every ep rank, each weighted 1/ep; an expert slice's over edp to
        the slice's square, weighted 1, and the ep sum adds the slices."""
        if unscale != 1.0:
            torch._foreach_mul_([u.grad_shard for u in self.units], unscale)
        whole = self.shards.comm.size == 1 and self.shards.ep is None
        skip = self.shards.counted_elsewhere
        device = self.units[0].flat.device  # the collectives' (offloaded shards: the host's)
        totals = {c.comm: torch.zeros((), device=device) for c in self.comms}  # per group
        for u in self.units:
            g, total = u.grad_shard, totals[u.comm.comm]
            if whole and not skip:
                total += g.square().sum().to(device)
                continue
            for i, a, b in u.shard_runs(lambda i, u=u: u.names[i] not in skip):
                share = self.shards.norm_share(u.names[i])
                total += (g[a:b].square().sum() * share).to(device)
        for comm, total in totals.items():  # the same order on every rank
            comm.all_reduce(total, "sum", tag="grad_norm")
        total = self.shards.sum_norm_squared(sum(totals.values())).sqrt()
        if max_norm < float("inf"):
            scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for u in self.units:
                u.grad_shard.mul_(scale.to(u.grad_shard.device))
        return total

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Update this rank's shards; stages 1 and 2 then all-gather the new parameters.
        Offloaded ZeRO-3 parameters are updated where they live (their masters) only."""
        self.optimizer.step([u.grad_shard for u in self.units],
                            None if self.offload_params else [u.shard for u in self.units], lr)
        self.gather_shards()

    def gather_shards(self) -> None:  # stages 1-2: the full parameters (callers: no_grad)
        if self.stage == 3:
            return
        for h in [u.comm.gather_params(u, u.flat, u.shard.clone(), phase="step")  # a copy:
                  for u in self.units]:  # the input must not alias the output
            h.wait()

    replica_view = zero_view  # -> ReplicaView (parallel/replica/view.py)

    # ------------------------------------------------------------------ state

    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This tp (and ep) rank's parameters (fp32, from the master shards; collective over
        each unit's group). An offloaded master lives on the host: it travels from the
        device, as the group needs."""
        out = {}
        for k, u in enumerate(self.units):
            full = torch.empty(u.padded, device=u.shard.device)  # [padded] fp32
            master = self.optimizer.master(k).to(full.device, torch.float32)  # [shard]
            u.comm.gather_state(u, full, master)
            for name, view in zip(u.names, u.param_views(full)):
                out[name] = view.clone()
        return out

    def memory(self) -> dict[str, int]:
        """Model-state bytes this rank holds, from the tensors: parameters (stages 1-2 the
        full flat buffers, stage 3 the shards; units gathered for compute are transient, as
        are a pipeline's full copies held through a step), gradients, master weights and
        optimizer state. Offloaded ZeRO-3 shards count their staging buffers' storage: none
        at rest, a unit's shard while it is gathered (gather.py). Under zero_accumulate =
        unsharded, `kept_*_bytes`: what the last step kept (accumulate.py)."""
        if self.offload_params:
            params = sum(u.shard.untyped_storage().nbytes() for u in self.units)
        elif self.stage == 3:
            params = nbytes(*(u.shard for u in self.units))
        else:
            params = nbytes(*(u.flat for u in self.units))
        params += sum(c.held_param_bytes for c in self.comms)
        return {"params_bytes": params, "grads_bytes": self.reducer.grad_bytes,
                **getattr(self.reducer, "kept", {}), **self.optimizer.memory()}

    def state_pieces(self) -> list[Piece]:
        """The module's tensors outside the units (buffers, frozen weights), the master
        shards and the moment shards, as they are on this rank (parallel/pieces.py)."""
        in_units = {n for u in self.units for n in u.names}
        return module_pieces(self.shards, skip=in_units) + zero_pieces(
            self.shards, self.units, self.optimizer.shard_state, self.moment_names)

    def optim_steps(self) -> int:
        return self.optimizer.steps

    @torch.no_grad()
    def load_state(self, reader: Reader, steps: int) -> None:
        """Master and moment shards from their runs; parameters from the master (stage 3)
        or their whole blocks (stages 1-2 hold every parameter)."""
        in_units = {n for u in self.units for n in u.names}
        self.shards.model.load_state_dict(local_model_state(self.shards, reader, skip=in_units),
                                          strict=False)
        zero_load(self.shards, self.units, reader, self.moment_names, self.optimizer)
        for k, u in enumerate(self.units):
            if self.stage < 3:
                for name, p, view in zip(u.names, u.params, u.param_views(u.flat)):
                    view.copy_(local_tensor(self.shards, reader, model_key(name), name, p))
            elif not self.offload_params:  # an offloaded one is its master
                u.shard.copy_(self.optimizer.master(k))
        self.optimizer.steps = steps

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        return {}  # all of it is in the pieces

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        pass
