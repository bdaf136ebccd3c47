"""A parallel layout for the planner, parsed from `dp=..,tp=..` text and checked against a
model, a cluster and a batch before anything is computed.

Rank order (ARCHITECTURE.md): tp innermost, then cp, then dp, then pp outermost, so a
tensor-parallel group is `tp` consecutive ranks and sits inside a node when tp <= node
size. ep is carved out of dp x cp. The global batch is dp x micro_batch x microbatches
sequences; cp splits each sequence, not the batch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from shardtrain.config import Config, ConfigError, DataConfig, ModelConfig
from shardtrain.config.precision import TRUE16
from shardtrain.model.sdpa_kernels import attention_kernel
from shardtrain.plan.layout_checks import (REPLICA_FIELDS, PlanError, check_choices,
                                           check_context_parallel, check_layer_partition,
                                           check_replica_groups)
from shardtrain.plan.optim_states import config_optim, optim_fields

@dataclass(frozen=True, kw_only=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_mode: str = "ring"  # ring attention or Ulysses all-to-alls (parallel.cp_mode)
    ep: int = 1
    zero: int = 0
    unit_blocks: int = 1  # ZeRO-3: transformer blocks per unit (parallel.zero_unit_blocks)
    partition: str = "flat"  # ZeRO-3: flat or layer (parallel.zero_partition)
    # ZeRO-2/3 under accumulation: sharded or unsharded (parallel.zero_accumulate,
    # plan/accumulate.py)
    accumulate: str = "sharded"
    offload: str = "none"
    precision: str = "bf16"
    reduce_dtype: str = ""  # gradients on the wire (train.grad_reduce_dtype); "": precision's
    recompute: str = "none"
    activation_offload: str = "none"  # cpu: train.activation_offload (activation_offload.py)
    sp: bool = False
    micro_batch: int = 1  # sequences per forward/backward on one data-parallel rank
    microbatches: int = 1  # m: micro-batches per optimizer step
    schedule: str = "1f1b"
    v: int = 1  # virtual stages per pipeline rank (interleaved schedule)
    ps_servers: int = 0  # parameter servers beside the dp workers (plan/ps.py)
    # SDPA's kernel (`planned_attention`): flash or memory-efficient keep out + logsumexp
    # (efficient: k, v repeated to the query heads for it under GQA); math keeps the
    # probabilities, the S x S term (plan/activations.py)
    attention: str = "flash"
    # ZeRO++ (Wang et al. 2023; plan/zeropp.py): int8 weight gathers, a node-local secondary
    # parameter shard (ZeRO-3), int8 gradient reduce-scatters (two hops across nodes)
    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    optim: str = "adamw"  # OPTIM_STATES: the optimizer state's K (plan/memory.py)
    fp8: str = "none"  # train.fp8; ZeRO-3's fp8 weight gathers where cost/fp8.py says
    bf16_update: str = "nearest"  # optim.bf16_update: kahan adds 2 bytes per parameter

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp + self.ps_servers

    # Replica groups (parallel.replicas, docs/planner.md): dp splits into `replicas` groups,
    # sharded inside (ZeRO over `nd`: HSDP); `sync` says what crosses them: the gradients
    # every step, or the weights every `sync_every` steps in `sync_fragments` slices
    # (plan/replica_traffic.py). dp stays the total over the groups.
    replicas: int = 1
    sync: str = "every_step"
    sync_every: int = 1
    sync_fragments: int = 1

    @property
    def nd(self) -> int:
        """Ranks of one replica group holding the same dense parameters: the gradient and
        ZeRO group (dp x cp / replicas; FORMULAS.md's Nd)."""
        return self.dp * self.cp // self.replicas

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1]
        if self.cp > 1 and self.cp_mode != "ring":
            parts.append(f"cp_mode={self.cp_mode}")
        parts += [f"zero={self.zero}", f"mb={self.micro_batch}", f"m={self.microbatches}"]
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.activation_offload != "none":
            parts.append(f"activation_offload={self.activation_offload}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.v})" if self.v > 1 else ""))
        parts += [f"{k}={v}" for k, v in (("unit_blocks", self.unit_blocks),
                                          ("partition", self.partition),
                                          ("accumulate", self.accumulate))
                  if v not in (1, "flat", "sharded")]
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        parts += [f"fp8={self.fp8}"] if self.fp8 != "none" else []
        if self.replicas > 1:
            parts.append(f"replicas={self.replicas} sync={self.sync}" + (
                f"(H={self.sync_every}, F={self.sync_fragments})" if self.sync_every > 1 else ""))
        if self.ps_servers:
            parts.append(f"ps_servers={self.ps_servers}")
        if self.attention != "flash":
            parts.append(f"attention={self.attention}")
        parts += [k for k in ("qwz", "hpz", "qgz") if getattr(self, k)]
        parts += [f"optim={self.optim}"] if self.optim != "adamw" else []
        parts += [f"precision={self.precision}"] if self.precision in TRUE16 else []
        parts += [f"bf16_update={self.bf16_update}"] if self.bf16_update != "nearest" else []
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check(layout: Layout, cfg: ModelConfig, *, gpus: int, node_size: int, global_batch: int,
          seq_len: int) -> None:
    """Raise PlanError naming the field and the fix if the layout cannot run."""
    lay = layout
    check_choices(lay)
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "microbatches", "v", "replicas"):
        if getattr(lay, name) < 1:
            raise PlanError(f"layout {name}={getattr(lay, name)} must be >= 1")
    if lay.gpus != gpus:
        raise PlanError(f"layout dp={lay.dp} x tp={lay.tp} x pp={lay.pp} x cp={lay.cp}"
                        f"{f' + ps_servers={lay.ps_servers}' if lay.ps_servers else ''} = "
                        f"{lay.gpus} does not equal --gpus {gpus}; change dp (or leave it out "
                        "to fill the GPUs) or --gpus")
    if lay.ps_servers and (lay.tp, lay.pp, lay.cp, lay.ep, lay.zero) != (1, 1, 1, 1, 0):
        raise PlanError(f"layout ps_servers={lay.ps_servers} serves whole model replicas: "
                        "set tp, pp, cp, ep to 1 and zero to 0 (as parallel.ps_servers does)")
    if lay.ps_servers < 0:
        raise PlanError(f"layout ps_servers={lay.ps_servers} must be >= 0")
    if lay.tp > node_size:
        raise PlanError(f"layout tp={lay.tp} is above the node size {node_size} "
                        "(--gpus-per-node): tensor parallelism communicates in every layer and "
                        f"must stay inside a node; use tp <= {node_size} and more pp or dp")
    if cfg.n_heads % lay.tp or cfg.ffn_hidden % lay.tp:
        raise PlanError(f"layout tp={lay.tp} must divide model.n_heads={cfg.n_heads} and the "
                        f"MLP width {cfg.ffn_hidden}")
    if lay.pp > cfg.n_layers:
        raise PlanError(f"layout pp={lay.pp} exceeds model.n_layers={cfg.n_layers}")
    check_context_parallel(lay, cfg, seq_len=seq_len)
    check_replica_groups(lay)
    if lay.ep > 1 and (not cfg.n_experts or cfg.n_experts % lay.ep or lay.nd % lay.ep):
        raise PlanError(f"layout ep={lay.ep} needs a mixture-of-experts model whose "
                        f"model.n_experts={cfg.n_experts} and dp x cp = {lay.nd} it divides")
    if lay.dp * lay.micro_batch * lay.microbatches != global_batch:
        raise PlanError(f"layout dp={lay.dp} x micro_batch={lay.micro_batch} x microbatches="
                        f"{lay.microbatches} = {lay.dp * lay.micro_batch * lay.microbatches} does "
                        f"not equal the global batch {global_batch} (--global-batch)")
    if not 0 <= lay.zero <= 3:
        raise PlanError(f"layout zero={lay.zero} must be 0, 1, 2 or 3")
    if lay.unit_blocks < 1 or (lay.unit_blocks != 1 and lay.zero != 3):
        raise PlanError(f"layout unit_blocks={lay.unit_blocks} must be >= 1 and needs zero=3 "
                        "(ZeRO-3's gather units); drop it or set zero=3")
    check_layer_partition(lay, cfg)
    if (lay.offload == "cpu" and lay.zero < 1) or (lay.offload == "nvme" and lay.zero != 3):
        raise PlanError(f"layout offload={lay.offload} needs zero >= 1 (cpu) or zero = 3 (nvme): "
                        "offloading moves the sharded optimizer state")
    if (lay.qwz or lay.qgz) and not lay.zero or lay.hpz and (lay.zero != 3 or lay.pp > 1):
        raise PlanError("layout qwz and qgz quantize ZeRO's collectives (zero >= 1); hpz keeps "
                        "a node-local copy for ZeRO-3's backward gathers (zero = 3, pp = 1)")
    if lay.sp and lay.tp == 1:
        raise PlanError("layout sp=true needs tp > 1: sequence parallelism splits along the "
                        "tensor-parallel group")
    if lay.schedule == "interleaved":
        if lay.pp == 1 or lay.v < 2 or lay.microbatches % lay.pp:
            raise PlanError(f"layout schedule=interleaved needs pp > 1, v >= 2 and microbatches "
                            f"a multiple of pp (got pp={lay.pp}, v={lay.v}, "
                            f"microbatches={lay.microbatches})")
        if lay.pp * lay.v > cfg.n_layers:
            raise PlanError(f"layout pp x v = {lay.pp * lay.v} exceeds "
                            f"model.n_layers={cfg.n_layers}")
    elif lay.schedule in ("zbv", "dualpipev"):
        least = 2 * lay.pp if lay.schedule == "dualpipev" else 1
        if lay.pp == 1 or lay.v != 2 or cfg.n_layers % (2 * lay.pp) or lay.microbatches < least:
            raise PlanError(f"layout schedule={lay.schedule} needs pp > 1, v = 2, model.n_layers "
                            f"a multiple of 2 pp and microbatches >= {least} (got pp={lay.pp}, "
                            f"v={lay.v}, microbatches={lay.microbatches})")
    elif lay.v != 1:
        raise PlanError(f"layout v={lay.v} needs schedule=interleaved, zbv or dualpipev")


def _config_fields(layout: Layout, *, seq_len: int | None,
                   offload_dir: str) -> dict[tuple[str, str], Any]:
    """(section, field) -> value of the training config that runs `layout` (the one
    mapping `layout_overrides` and `layout_config` share)."""
    lay = layout
    pairs: dict[tuple[str, str], Any] = {
        ("parallel", "dp"): lay.dp, ("parallel", "tp"): lay.tp, ("parallel", "pp"): lay.pp,
        ("parallel", "cp"): lay.cp, ("parallel", "cp_mode"): lay.cp_mode,
        ("parallel", "ep"): lay.ep, ("parallel", "sp"): lay.sp, ("parallel", "zero"): lay.zero,
        ("parallel", "zero_unit_blocks"): lay.unit_blocks,
        ("parallel", "zero_partition"): lay.partition,
        ("parallel", "zero_accumulate"): lay.accumulate,
        ("parallel", "offload"): lay.offload, ("parallel", "microbatches"): lay.microbatches,
        ("parallel", "schedule"): lay.schedule, ("parallel", "virtual_stages"): lay.v,
        ("parallel", "ps_servers"): lay.ps_servers, ("train", "micro_batch"): lay.micro_batch,
        ("train", "global_batch"): lay.dp * lay.micro_batch * lay.microbatches,
        ("train", "activation_checkpointing"): lay.recompute,
        ("train", "activation_offload"): lay.activation_offload,
        ("train", "precision"): lay.precision if lay.precision in ("fp32", *TRUE16) else "bf16",
        **({("train", "grad_reduce_dtype"): lay.reduce_dtype} if lay.reduce_dtype else {}),
        ("parallel", "zero_quantized_weights"): lay.qwz, ("parallel", "zero_hpz"): lay.hpz,
        ("parallel", "zero_quantized_gradients"): lay.qgz, ("train", "fp8"): lay.fp8,
    }
    if lay.replicas > 1:  # one group (the default) runs as without groups
        pairs |= {("parallel", k): getattr(lay, k) for k in REPLICA_FIELDS}
    if lay.offload == "nvme":
        pairs["parallel", "offload_dir"] = offload_dir
    pairs |= optim_fields(lay.optim)
    if lay.bf16_update != "nearest":
        pairs["optim", "bf16_update"] = lay.bf16_update
    if seq_len is not None:
        pairs["train", "seq_len"] = seq_len
    return pairs


def layout_overrides(layout: Layout, *, seq_len: int | None = None,
                     offload_dir: str = "offload") -> list[str]:
    """The `--section.field VALUE` overrides that make a training config run `layout`
    (config.load(preset, overrides)): the degrees, ZeRO, ZeRO++ and offload, the schedule, the
    batch geometry (global_batch = dp x micro_batch x microbatches) and recomputation.
    Precision: fp32, bf16-true and fp16-true stay; bf16 and amp both train under
    train.precision=bf16 (the amp policy). `attention` has no config field: it follows from the precision and the
    model (`planned_attention`)."""
    fields = _config_fields(layout, seq_len=seq_len, offload_dir=offload_dir)
    return [item for (section, name), value in fields.items()
            for item in (f"--{section}.{name}", str(value).lower() if isinstance(value, bool)
                         else str(value))]


def layout_config(layout: Layout, cfg: ModelConfig, *, seq_len: int,
                  data: DataConfig | None = None) -> Config:
    """The training Config (defaults elsewhere, `data` the run's data section: what it
    asks of the layout, data.document_mask, counts) that runs `layout` on model `cfg`."""
    out = Config(model=cfg, data=copy.deepcopy(data) if data is not None else DataConfig())
    for (section, name), value in _config_fields(layout, seq_len=seq_len,
                                                 offload_dir="offload").items():
        setattr(getattr(out, section), name, value)
    return out


def trainer_refusal(layout: Layout, cfg: ModelConfig, *, seq_len: int,
                    data: DataConfig | None = None) -> str | None:
    """Why the trainer's own config validation (`Config.validate`) refuses `layout` (with
    `data`, the run's data section), or None when it runs: the planner proposes only what
    the trainer accepts."""
    try:
        layout_config(layout, cfg, seq_len=seq_len, data=data).validate(layout.gpus)
    except ConfigError as e:
        return str(e)
    return None


def config_layout(cfg: Config, world_size: int, device_type: str | None = None) -> Layout:
    """The Layout a validated training config runs on `world_size` ranks: the inverse of
    `layout_overrides` (train.precision bf16 and fp16 are the runtime's `amp` policy), its
    attention kernel that of `device_type` (None: train.device, auto counted as cpu)."""
    p, t = cfg.parallel, cfg.train
    dp = p.resolved_dp(world_size)
    return Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, cp_mode=p.cp_mode, ep=p.ep, zero=p.zero,
                  unit_blocks=p.zero_unit_blocks, partition=p.zero_partition,
                  accumulate=p.zero_accumulate, offload=p.offload,
                  precision=t.precision if t.precision in ("fp32", *TRUE16) else "amp",
                  bf16_update=cfg.optim.bf16_update,
                  reduce_dtype="" if t.grad_reduce_dtype == "fp32" else t.grad_reduce_dtype,
                  recompute=t.activation_checkpointing,
                  activation_offload=t.activation_offload, sp=p.sp, micro_batch=t.micro_batch,
                  microbatches=p.microbatches or t.global_batch // (dp * t.micro_batch),
                  schedule=p.schedule, v=p.virtual_stages, ps_servers=p.ps_servers,
                  qwz=p.zero_quantized_weights, hpz=p.zero_hpz,
                  qgz=p.zero_quantized_gradients, optim=config_optim(cfg.optim), fp8=t.fp8,
                  **{k: getattr(p, k) for k in REPLICA_FIELDS},
                  attention=planned_attention(cfg.model, t.precision, device_type or (
                      "cuda" if t.device == "cuda" else "cpu")))


def planned_attention(cfg: ModelConfig, precision: str, device_type: str = "cuda") -> str:
    """The SDPA kernel attention runs on, for every (precision, mask, GQA): the runtime's
    rule (model/sdpa_kernels.py). Packed documents (data.document_mask) run one causal call
    per document, no mask (model/attention.py), so they get the kernel a plain causal call
    gets; grouped kv heads do too (repeated for the memory-efficient kernel, which takes
    none). On a GPU: flash in 16 bits (bf16, amp), memory-efficient in fp32; math only for a
    head dim neither takes, and then the planner charges its S x S probabilities."""
    dtype = {"fp32": "float32", "fp16": "float16", "fp16-true": "float16"}.get(
        precision, "bfloat16")
    return attention_kernel(device_type, dtype, cfg.qk_head_dim)
