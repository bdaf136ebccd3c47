"""The planner's input error, and the checks of a layout's ZeRO-3 partition and context
parallelism (layout.py `check` runs them; split from it to keep each file short)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from shardtrain.plan.layout import Layout


class PlanError(ConfigError):
    """Bad planner input; the message names the field and the fix."""


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
