"""The planner's side of `parallel.zero_accumulate` (parallel/zero/accumulate.py): what
ZeRO-2 and ZeRO-3 keep through a step when they accumulate unsharded.

- Memory: the stage's full gradient in the precision's gradient bytes (the runtime's fp32
  accumulation buffers under fp32 and amp), and under ZeRO-3 every unit gathered
  (`zero3_gather_bytes`: under amp the weights autocast rounds in 16 bits), from the step's
  first micro-batch to its reduce-scatter in the last backward. memory.py adds it to the
  step's buffers; between steps only the shards stay.
- Traffic (traffic.py `data_parallel_ops(unsharded=True)`): one reduce-scatter per step
  and, under ZeRO-3, one all-gather: the bytes of one micro-batch whatever their number.
"""

from __future__ import annotations

from shardtrain.plan.memory import STATE_BYTES, zero3_gather_bytes


def kept_bytes(params: float, *, zero: int, precision: str, kept: float = 0.0) -> float:
    """Bytes one rank keeps through a step under unsharded accumulation of its `params`
    parameters (module docstring; `kept`: those ZeRO-3 gathers in fp32 under amp). The
    runtime's ledger measures the same (`kept_grads_bytes` + `kept_params_bytes`)."""
    grads = STATE_BYTES[precision][1] * params
    return grads + (zero3_gather_bytes(params, kept, precision) if zero == 3 else 0.0)
