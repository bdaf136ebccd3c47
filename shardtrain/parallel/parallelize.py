"""parallelize(model, mesh, cfg): apply a layout to the plain model, in one documented order.

Order: tensor/sequence parallel (tensor/) -> context parallel (context/) -> expert
parallel (expert/) -> fp8 linears (quant/float8.py, when train.fp8) -> compiled blocks
(compile.py, when train.compile) -> activation checkpointing -> activation offload
(offload_activations.py) -> pipeline split (pipeline/) -> ZeRO (zero/) or data parallel
(data/), or a parameter server (ps/). Expert parallelism swaps
each MoE layer's experts for this rank's slice (placements over the ep group, beside the
tp ones in StageShards) and, where cp or sp split a micro-batch's tokens, gives the MoE
layers their token group (expert/groups.py). Context parallelism
comes after tensor parallelism because it replaces the attention core of the (possibly
head-split) attention, and before checkpointing because selective recomputation wraps
whichever core is in place.
Under context parallelism the update half works over dp x cp (`mesh.replica_dim`).
Every layout runs its micro-batches through the pipeline executor: without pipeline
parallelism that is one stage holding the whole model, and the schedule is plain gradient
accumulation.

The result is a `Strategy` (strategy.py): the model half (stage shards and pipeline) and
the update half the config asks for (`ReplicatedUpdate`, `SparseUpdates`, `ZeroModel` or
`PSUpdate`),
so the trainer drives every layout through the same calls.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from shardtrain.comm import Communicator
from shardtrain.config import Config
from shardtrain.config.fp8 import check_fp8
from shardtrain.cost.fp8 import fp8_gathers
from shardtrain.mesh import ParallelMesh
from shardtrain.model.mtp import MTPLoss
from shardtrain.model.transformer import Transformer, init_state_buffers
from shardtrain.parallel.build import Fill, ModuleTarget, Values, filler, materialize
from shardtrain.parallel.activation import checkpoint_attention_cores, checkpoint_blocks
from shardtrain.parallel.compile import compile_blocks
from shardtrain.parallel.context.apply import apply_context_parallel
from shardtrain.parallel.context.balance import held_positions
from shardtrain.parallel.data.ddp import DataParallel, ReplicatedUpdate
from shardtrain.parallel.data.topk import SparseUpdates
from shardtrain.parallel.expert.groups import apply_token_groups
from shardtrain.parallel.expert.layers import apply_expert_parallel
from shardtrain.parallel.offload_activations import ActivationOffload
from shardtrain.parallel.expert.reduce import (ExpertDataParallel, expert_grad_scale,
                                               expert_parameters)
from shardtrain.parallel.pipeline.runtime import Pipeline
from shardtrain.parallel.pipeline.schedules import placement
from shardtrain.parallel.pipeline.stage import split_stages
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.precision import LossScaler, PrecisionPolicy
from shardtrain.parallel.ps.update import PSUpdate, steps_together
from shardtrain.parallel.strategy import Strategy, Update, rank_file
from shardtrain.parallel.tensor.layers import apply_tensor_parallel
from shardtrain.parallel.tensor.mtp import apply_mtp_tensor_parallel
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.parallel.zero.fp8_gather import Float8GatherComm
from shardtrain.parallel.zero.model import ZeroModel
from shardtrain.parallel.zero.zeropp import build_unit_comm
from shardtrain.quant.float8 import convert_blocks

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def parallelize(model: Transformer, mesh: ParallelMesh, cfg: Config, *,
                device: torch.device, make_optimizer: MakeOptimizer,
                values: Callable[[StageShards], Values] | None = None) -> Strategy:
    """Apply the layout to `model`, built on the meta device (`build_model(seed=None)`), in
    place: swap in tensor-parallel modules, give this rank's share storage on `device`
    (build.py: its stage, its slices, under ZeRO-3 only its shards) and fill it from
    `values(shards)` (default: the seeded slices of the single-process weights;
    train/finetune/finetune.py `start_values` adds model.init_from and QLoRA's bases), then
    checkpoint activations and hook data parallelism or ZeRO over the dp group.
    `make_optimizer` builds the torch optimizer of the replicated layout; ZeRO builds its
    shard optimizer from `cfg.optim` (the same update, weight decay on matrices only)."""
    tp, pp = mesh.comm("tp"), mesh.comm("pp")
    placements, loss = {}, cross_entropy
    if tp.size > 1:
        placements, loss = apply_tensor_parallel(model, tp, sp=cfg.parallel.sp)
        placements |= apply_mtp_tensor_parallel(model, tp, sp=cfg.parallel.sp)
    if cfg.model.mtp_depth:  # the main and the depths' losses, on the same cross-entropy
        loss = MTPLoss(loss, cfg.model)
    split = apply_context_parallel(model, mesh.comm("cp"), cfg)
    ep, ep_placements = None, None
    if mesh.shape.ep > 1:
        ep = mesh.comm("ep")
        ep_placements = apply_expert_parallel(model, ep)
    apply_token_groups(model, tp, mesh.comm("cp"), sp=cfg.parallel.sp)
    fp8_names: list[str] = []  # the converted weights (ZeRO-3 may gather them in fp8)
    if cfg.train.fp8 != "none":  # on meta, before compile and checkpointing wrap the blocks
        check_fp8(cfg)  # again, on the precision the device resolved
        fp8_names = convert_blocks(model, cfg.train.fp8)
    # the blocks compiled and recomputed: the main ones and the MTP modules' (model/mtp.py)
    blocks = [*model.layers, *(m.block for m in model.mtp or [])]
    if cfg.train.compile:  # before checkpointing: a checkpoint runs the compiled forward
        compile_blocks(blocks)
    if cfg.train.activation_checkpointing == "full":
        checkpoint_blocks(blocks)
    elif cfg.train.activation_checkpointing == "selective":  # after cp: it sees the cp core
        checkpoint_attention_cores(blocks)
    offload = None
    if cfg.train.activation_offload == "cpu":  # last: a checkpoint saves through its hooks
        offload = ActivationOffload(device)
        offload.install(model.layers)
    # Pipeline split: this rank's stage (the model itself when pp = 1), the only part
    # materialised; the full model's names order the layout-independent state dicts.
    module, chunks = split_stages(model, cfg, stage=pp.rank)
    reference_keys = list(model.state_dict())
    zero = bool(cfg.parallel.zero) and not cfg.parallel.ps_servers
    module.tie_weights()  # on meta: the swapped-in tp modules share one tensor again
    policy = PrecisionPolicy.from_config(cfg)  # the one source of every dtype below
    # ZeRO's trainable parameters get their storage from its units (build.py).
    materialize(module, device, leave=lambda p: zero and p.requires_grad,
                dtype=policy.param_dtype)
    init_state_buffers(module, cfg.model)
    if split is not None:  # RoPE and learned positions: the global positions held here
        module.positions = split.positions(mesh.comm("cp").rank, device)
        # under packed documents, those of the batch's balanced split (context/balance.py)
        module.held_for = partial(held_positions, split, mesh.comm("cp").rank, device)
    par = cfg.parallel  # tied copies on two stages exchange gradients (state.py)
    apart = placement(par.schedule, par.pp, par.virtual_stages).ends_apart
    shards = StageShards(module, tp, placements, pp=pp, reference_keys=reference_keys,
                         tied=cfg.model.table_at_ends and apart, ep=ep,
                         ep_placements=ep_placements)
    fill = filler(values(shards) if values is not None else
                  lambda wants: shards.initial_values(cfg.train.seed, wants))
    pipeline = Pipeline(chunks, mesh, cfg, loss=loss, device=device, policy=policy,
                        split=split)
    if zero:
        update = _zero(module, shards, mesh, cfg, policy, fill=fill, device=device,
                       fp8_names=fp8_names)
    else:  # the replicated layouts hold the whole stage: filled before they copy it
        fill(ModuleTarget(module))
        update = _update(module, shards, mesh, cfg, policy, make_optimizer,
                         shared_uses(chunks))
    return Strategy(shards=shards, pipeline=pipeline, update=update,
                    policy=policy, scaler=LossScaler.from_config(cfg),
                    average_loss=steps_together(cfg), activation_offload=offload)


def _zero(module: torch.nn.Module, shards: StageShards, mesh: ParallelMesh, cfg: Config,
          policy: PrecisionPolicy, *, fill: Fill, device: torch.device,
          fp8_names: list[str]) -> ZeroModel:
    """ZeRO over the replica group (dp, or dp x cp), the experts over edp; its units are
    built first and filled in place (build.py). The converted fp8 weights are gathered in
    fp8 where cost/fp8.py says so (zero/fp8_gather.py)."""
    dp, c, p = mesh.comm(mesh.replica_dim), cfg.comm, cfg.parallel
    unit_comm = build_unit_comm(mesh, p, block=c.quant_block)  # ZeRO++
    if fp8_gathers(fp8=cfg.train.fp8, zero=p.zero, partition=p.zero_partition, tp=p.tp,
                   sixteen_bit=policy.gather_dtype != torch.float32,
                   zeropp=p.zero_hpz or p.zero_quantized_gradients):
        unit_comm = Float8GatherComm(dp, fp8_names=fp8_names)
    experts, expert_comm = set(), None
    if mesh.shape.ep > 1:
        experts = expert_parameters(module)
        expert_comm = build_unit_comm(mesh, cfg.parallel, block=c.quant_block, dim="edp",
                                      grad_scale=expert_grad_scale(mesh.shape.ep))
    return ZeroModel(module, dp, shards, cfg, policy, unit_comm=unit_comm, experts=experts,
                     expert_comm=expert_comm, fill=fill, device=device)


def shared_uses(chunks: list[torch.nn.Module]) -> dict[torch.nn.Parameter, int]:
    """Parameters more than one of this rank's pipeline chunks uses, with how many: the
    tied table under the V placement (embedding and head both on stage 0), whose gradient
    is complete only after both chunks' backwards."""
    if len(chunks) < 2:
        return {}
    uses: dict[torch.nn.Parameter, int] = {}
    for chunk in chunks:
        for p in chunk.used_parameters():
            uses[p] = uses.get(p, 0) + 1
    return {p: n for p, n in uses.items() if n > 1}


def _update(module: torch.nn.Module, shards: StageShards, mesh: ParallelMesh, cfg: Config,
            policy: PrecisionPolicy, make_optimizer: MakeOptimizer,
            arrivals: dict[torch.nn.Parameter, int]) -> Update:
    """The update half of a replicated layout: a parameter server's worker, top-k update
    compression, or plain bucketed data parallelism. `arrivals`: shared_uses."""
    dp, c = mesh.comm(mesh.replica_dim), cfg.comm
    if cfg.parallel.ps_servers:
        return PSUpdate(module, mesh, cfg, shards)
    if c.compress == "topk":
        return SparseUpdates(dp, make_optimizer(module), shards, ratio=c.topk_ratio,
                             error_feedback=c.error_feedback, warmup_steps=c.topk_warmup_steps,
                             file=rank_file(mesh.coords))
    reducer = _reducer(module, mesh, dp, cfg, policy, arrivals)
    return ReplicatedUpdate(reducer, make_optimizer(module), shards)


def _reducer(module: torch.nn.Module, mesh: ParallelMesh, dp: Communicator, cfg: Config,
             policy: PrecisionPolicy, arrivals: dict[torch.nn.Parameter, int]
             ) -> DataParallel | ExpertDataParallel:
    """Bucketed gradient averaging over dp; under expert parallelism the experts' own
    reducer over edp (expert/reduce.py)."""
    c = cfg.comm
    kw = {"bucket_mb": c.bucket_mb, "compress": c.compress, "quant_block": c.quant_block,
          "reduce_dtype": policy.reduce_dtype, "arrivals": arrivals}
    if mesh.shape.ep == 1:
        return DataParallel(module, dp, **kw)
    experts = expert_parameters(module)
    trained = [p for p in module.parameters() if p.requires_grad]
    dense = DataParallel(module, dp, params=[p for p in trained if p not in experts], **kw)
    return ExpertDataParallel(
        dense, DataParallel(module, mesh.comm("edp"), params=[p for p in trained if p in experts],
                            **kw), mesh.shape.ep)
