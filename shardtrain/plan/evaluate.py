"""One layout evaluated end to end: memory, communication and time, and its JSON form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtrain.config import ModelConfig
from shardtrain.plan.activation_offload import OffloadTerms, offload_terms
from shardtrain.plan.closed_form import narayanan_params, training_flops
from shardtrain.cost.counts import hardware_flops_per_token, model_flops_per_token, param_counts
from shardtrain.cost.hardware import Hardware
from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import (BUCKET_BYTES, STATE_BYTES, MemoryBreakdown, in_flight,
                                   memory_per_gpu)
from shardtrain.plan.partition import rank_params
from shardtrain.plan.ps import ps_summary
from shardtrain.plan.replica_traffic import cross_replica_bytes
from shardtrain.plan.roofline import RoofOp, roofline_ops
from shardtrain.plan.timing import StepTime, exposed, step_time, utilization
from shardtrain.plan.traffic import CommOp, bytes_per_step, step_ops

CONVENTIONS = {
    "units": "bytes, seconds, FLOPs (one multiply or one add; a matmul [m,k]x[k,n] is 2mkn)",
    "params": "exact: equals sum(p.numel()) of the built model; params_closed_form is "
              "Narayanan et al. 2021 (GPT style, no final LayerNorm)",
    "flops": "model FLOPs = forward + backward, causal attention not halved; hardware "
             "FLOPs add what the runtime recomputes (torch.utils.checkpoint with early "
             "stop; docs/recompute.md)",
    "memory": "per GPU on the busiest pipeline stage; bf16: params 2 + grads 2 + master 4 + "
              "optimizer (Adam m, v) 8 bytes per parameter (K = master + optimizer = 12); "
              "fp32: 4 + 4 + 0 + 8; bf16-true, fp16-true: 2 + 2 + 0 + 8 (kahan: +2 "
              "optimizer); ZeRO shards over dp x cp / replicas (one replica group); activations per Korthikanti "
              "Table 2 under bf16, what shardtrain's block keeps under fp32 and amp "
              "(docs/recompute.md), times in-flight micro-batches; offloaded bytes are "
              "not in total",
    "comm": "bytes sent per rank per step by group and op (ring all-reduce 2(n-1)/n S, "
            "all-gather / reduce-scatter (n-1)/n S); alpha-beta-gamma times from "
            "shardtrain.cost.collectives; group rep: across the replica groups, by ledger "
            "tag in rep_by_tag (sync_every > 1: averaged over the steps)",
    "goodput": "--mtbf-hours is one process's MTBF, the job failing at processes / MTBF; "
               "useful steps carry the full global batch; first order (plan/goodput.py)",
    "time": "step = (compute + exposed pipeline comm) / (1 - bubble_fraction) + exposed dp "
            "comm + optimizer + offload; compute and optimizer: each op at max(FLOPs / "
            "(peak x efficiency), bytes / memory_bw) (roofline); bubble_fraction of the "
            "pipeline time and bubble_ratio of the ideal time from the schedule simulator "
            "(1F1B: (p-1)/(m+p-1) and (p-1)/m); "
            "MFU/HFU against the precision's peak",
}


def fits(memory: MemoryBreakdown, hw: Hardware) -> bool:
    """The device's share within its usable bytes, and what offload keeps in host memory
    within the node's host memory per GPU (the same usable fraction)."""
    return memory.total <= hw.usable_bytes and \
        memory.host <= hw.usable_fraction * hw.host_memory_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    name: str
    cfg: ModelConfig
    hw: Hardware
    layout: Layout
    global_batch: int
    seq_len: int
    memory: MemoryBreakdown
    ops: tuple[CommOp, ...]
    time: StepTime
    roof: tuple[RoofOp, ...]  # one rank's ops on the roofline (plan/roofline.py)
    model_flops: float  # per step
    hardware_flops: float

    @property
    def fits(self) -> bool:
        return fits(self.memory, self.hw)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self, *, tokens: float | None = None,
                measured_step_s: float | None = None) -> dict[str, Any]:
        """The `shardtrain plan --json` document of this layout."""
        peak = self.hw.flops(self.layout.precision)
        out: dict[str, Any] = {
            "model": model_summary(self.cfg, self.seq_len, self.name, self.layout.recompute,
                                   self.layout.attention),
            "hardware": self.hw.to_dict(),
            "gpus": self.layout.gpus, "global_batch": self.global_batch, "seq": self.seq_len,
            "layout": self.layout.to_dict() | {"text": self.layout.describe()},
            "step": {"tokens": self.tokens, "model_flops": self.model_flops,
                     "hardware_flops": self.hardware_flops},
            "memory_per_gpu_bytes": self.memory.to_dict() | {
                "usable": self.hw.usable_bytes, "fits": self.fits},
            "comm": {"bytes_per_step": bytes_per_step(list(self.ops)),
                     "rep_by_tag": cross_replica_bytes(list(self.ops)),
                     "time_s": sum(op.time_s for op in self.ops),
                     "ops": [op.to_dict() for op in self.ops]},
            "time": self.time.to_dict(),
            "roofline": [op.to_dict() for op in self.roof],
        }
        if self.layout.ps_servers:
            out["ps"] = ps_summary(self.cfg, self.layout)
        terms = activation_offload_terms(self.cfg, self.layout, self.memory)
        if terms is not None:  # bytes per step and direction; the link's seconds
            out["activation_offload"] = terms.to_dict() | {
                "transfer_s": terms.transfer_s(self.hw.host_bw)}
        if measured_step_s is not None:
            out["measured"] = {
                "step_s": measured_step_s, "tokens_per_s": self.tokens / measured_step_s,
                "mfu": utilization(self.model_flops, measured_step_s, self.layout.gpus, peak),
                "hfu": utilization(self.hardware_flops, measured_step_s, self.layout.gpus, peak)}
        if tokens is not None:
            out["training_days"] = tokens / self.time.tokens_per_s / 86400
            if measured_step_s is not None:
                out["measured"]["training_days"] = tokens / out["measured"]["tokens_per_s"] / 86400
        return out


def model_summary(cfg: ModelConfig, seq_len: int, name: str = "",
                  recompute: str = "none", attention: str = "flash") -> dict[str, Any]:
    counts = param_counts(cfg)
    return {"name": name, "style": cfg.style, "params": counts.total,
            "params_non_embedding": counts.non_embedding, "params_active": counts.active,
            "params_closed_form": narayanan_params(cfg) if cfg.style == "gpt2" else None,
            "flops_per_token": model_flops_per_token(cfg, seq_len),
            "hardware_flops_per_token": hardware_flops_per_token(cfg, seq_len, recompute,
                                                                 attention),
            "flops_per_token_6n": training_flops(counts.active, 1)}


def evaluate(cfg: ModelConfig, layout: Layout, hw: Hardware, *, global_batch: int,
             seq_len: int, name: str = "", bucket_bytes: float = BUCKET_BYTES,
             memory: MemoryBreakdown | None = None) -> Plan:
    """Predict one layout (already `layout.check`ed). `memory` skips recomputing it."""
    lay = layout
    tokens = global_batch * seq_len
    model_flops = model_flops_per_token(cfg, seq_len) * tokens
    hardware_flops = hardware_flops_per_token(cfg, seq_len, lay.recompute, lay.attention) * tokens
    memory = memory or memory_per_gpu(cfg, lay, seq_len=seq_len, bucket_bytes=bucket_bytes,
                                      node_size=hw.node_size(lay.gpus))
    ops = step_ops(cfg, lay, hw, seq_len=seq_len, bucket_bytes=bucket_bytes)
    peak = hw.flops(lay.precision)
    roof = roofline_ops(cfg, lay, hw, global_batch=global_batch, seq_len=seq_len)
    share = backward_share(hardware_flops, model_flops)
    offload_s = _offload_seconds(cfg, lay, hw, memory)
    terms = activation_offload_terms(cfg, lay, memory)
    if terms is not None:  # the copies overlap the compute: what they take beyond it
        compute_s = sum(o.time_s for o in roof if o.in_pipeline)
        offload_s += terms.exposed_s(hw.host_bw, forward_s=compute_s * (1 - share),
                                     backward_s=compute_s * share)
    time = step_time(ops=ops, roof=roof, backward_share=share,
                     pp=lay.pp, microbatches=lay.microbatches, v=lay.v,
                     offload_s=offload_s, tokens=tokens,
                     model_flops=model_flops, hardware_flops=hardware_flops, gpus=lay.gpus,
                     peak_flops=peak, schedule=lay.schedule)
    return Plan(name=name, cfg=cfg, hw=hw, layout=lay, global_batch=global_batch,
                seq_len=seq_len, memory=memory, ops=tuple(ops), time=time, roof=tuple(roof),
                model_flops=model_flops, hardware_flops=hardware_flops)


def backward_share(hardware_flops: float, model_flops: float) -> float:
    """Backward's part of the step's compute: all but the forward's third of the model
    FLOPs (recomputation's FLOPs run inside backward)."""
    return (hardware_flops - model_flops / 3) / hardware_flops


def dp_exposed_s(plan: Plan) -> float:
    """Seconds of the plan's step that the dp (and edp) groups' communication leaves
    exposed, after the pipeline (timing.py `exposed`)."""
    backward_s = plan.time.compute_s * backward_share(plan.hardware_flops, plan.model_flops)
    return exposed(list(plan.ops), compute_s=plan.time.compute_s, backward_s=backward_s,
                   last_backward_s=backward_s / plan.layout.microbatches)[1]


def _offload_seconds(cfg: ModelConfig, layout: Layout, hw: Hardware,
                     memory: MemoryBreakdown) -> float:
    """Gradient shard down and parameter shard up over the host link; for NVMe also the
    offloaded state read and written once (see timing.py)."""
    if layout.offload == "none":
        return 0.0
    p_bytes, g_bytes = STATE_BYTES[layout.precision][:2]
    shard = rank_params(cfg, layout).total / layout.nd
    seconds = shard * (p_bytes + g_bytes) / hw.host_bw
    if layout.offload == "nvme":
        seconds += 2 * memory.offloaded / (hw.nvme_bw / hw.node_size(layout.gpus))
    return seconds


def activation_offload_terms(cfg: ModelConfig, layout: Layout,
                             memory: MemoryBreakdown) -> OffloadTerms | None:
    """Activation offload's host bytes, device window and bytes moved (activation_offload.py),
    None without it."""
    if layout.activation_offload == "none":
        return None
    return offload_terms(memory.activations_per_layer, layers=rank_params(cfg, layout).layers,
                         in_flight=in_flight(layout.schedule, layout.microbatches, layout.pp,
                                             layout.v),
                         microbatches=layout.microbatches)
