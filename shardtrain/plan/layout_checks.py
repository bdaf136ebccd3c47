"""The planner's input error, the choices a layout's fields take, and the checks of its
ZeRO-3 partition, context parallelism and replica groups (layout.py `check` runs them;
split from it to keep each file short)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.config.data import DataConfig
from shardtrain.config.parallel import CommConfig, ParallelConfig
from shardtrain.config.precision import TRUE16
from shardtrain.config.replicas import FaultConfig, check_replicas
from shardtrain.model.sdpa_kernels import KERNELS
from shardtrain.plan.optim_states import OPTIM_STATES

if TYPE_CHECKING:
    from shardtrain.plan.layout import Layout


class PlanError(ConfigError):
    """Bad planner input; the message names the field and the fix."""


# What parallel.schedule runs and the planner weighs: never pipedream-2bw, whose numbers
# differ from synchronous training by design (docs/planner.md).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")
ACTIVATION_OFFLOAD = ("none", "cpu")
# amp: the runtime's bf16/fp16 policy; bf16-true, fp16-true: 16-bit parameters (memory.py)
PRECISIONS = ("fp32", "bf16", "amp", *TRUE16)
BF16_UPDATES = ("nearest", "stochastic", "kahan")  # optim.bf16_update (bf16-true only)
CP_MODES = ("ring", "ulysses")  # parallel.cp_mode
# SDPA's kernel for attention: what activations keep (plan/activations.py)
ATTENTION = KERNELS
ACCUMULATE = ("sharded", "unsharded")  # parallel.zero_accumulate (plan/accumulate.py)
SYNCS = ("every_step", "local_sgd", "diloco")  # parallel.sync
# The Layout's fields that are [parallel]'s of the same name (replica groups)
REPLICA_FIELDS = ("replicas", "sync", "sync_every", "sync_fragments")


def check_choices(lay: Layout) -> None:
    """Each named field holds one of its choices."""
    for name, choices in (("schedule", SCHEDULES), ("recompute", RECOMPUTE),
                          ("offload", OFFLOAD), ("activation_offload", ACTIVATION_OFFLOAD),
                          ("precision", PRECISIONS),
                          ("cp_mode", CP_MODES), ("attention", ATTENTION),
                          ("optim", tuple(OPTIM_STATES)), ("accumulate", ACCUMULATE),
                          ("bf16_update", BF16_UPDATES), ("sync", SYNCS)):
        if getattr(lay, name) not in choices:
            raise PlanError(f"layout {name}={getattr(lay, name)!r} is not one of "
                            f"{', '.join(choices)}")
    if lay.bf16_update != "nearest" and lay.precision != "bf16-true":
        raise PlanError(f"layout bf16_update={lay.bf16_update} rounds bf16-true updates: set "
                        "precision=bf16-true or bf16_update=nearest")


def check_replica_groups(lay: Layout) -> None:
    """The trainer's own rule (config/replicas.py `check_replicas`: replicas divides dp, no
    parameter servers, sync's fields consistent), stated once there; and ep, carved out of a
    group's dp x cp, divides it."""
    parallel = ParallelConfig(dp=lay.dp, ps_servers=lay.ps_servers,
                              **{k: getattr(lay, k) for k in REPLICA_FIELDS})
    try:
        # the planner's layouts have no compression and no streamed data: their defaults
        check_replicas(SimpleNamespace(parallel=parallel, fault=FaultConfig(),
                                       comm=CommConfig(), data=DataConfig()), lay.gpus)
    except ConfigError as e:
        raise PlanError(f"layout: {e}") from None
    if lay.nd % lay.ep:
        raise PlanError(f"layout ep={lay.ep} must divide one replica group's dp x cp = "
                        f"{lay.nd} (dp={lay.dp} x cp={lay.cp} / replicas={lay.replicas}); "
                        "lower ep or replicas")


def check_layer_partition(lay: Layout, cfg: ModelConfig) -> None:
    """ZeRO-3's layer partition runs over plain data parallelism (parallel.zero_partition),
    and the planner counts it for dense models (plan/layer_partition.py)."""
    if lay.partition not in ("flat", "layer"):
        raise PlanError(f"layout partition={lay.partition!r} is not one of flat, layer")
    if lay.partition == "layer" and (lay.zero != 3 or lay.gpus != lay.dp or cfg.n_experts
                                     or lay.offload != "none"):
        raise PlanError("layout partition=layer needs zero=3 over dp alone (tp = pp = cp = 1, "
                        "no parameter servers), no offload and a dense model; use "
                        "partition=flat")


def check_context_parallel(lay: Layout, cfg: ModelConfig, *, seq_len: int) -> None:
    """The sequence splits evenly (2 cp chunks per rank: the zigzag split); Ulysses trades
    the sequence split for a head split, so cp must divide each tp rank's query heads."""
    if seq_len % (2 * lay.cp if lay.cp > 1 else 1):
        raise PlanError(f"layout cp={lay.cp} must divide the sequence length {seq_len} into "
                        f"2 x cp = {2 * lay.cp} equal chunks (the zigzag split); change cp or "
                        "--seq")
    heads = cfg.n_heads // lay.tp
    if lay.cp > 1 and lay.cp_mode == "ulysses" and heads % lay.cp:
        raise PlanError(f"layout cp_mode=ulysses with cp={lay.cp}: each tp rank's "
                        f"{heads} query heads (model.n_heads={cfg.n_heads} / tp={lay.tp}) "
                        f"must split evenly over cp; use cp_mode=ring or a cp dividing {heads}")
