"""Bytes per parameter of each precision's model states, and of what its gradients and
Kahan's compensation add: the one table memory.py, traffic.py and rank_states.py read.

- bf16 (the published mixed-precision convention): params 2, grads 2, fp32 master 4,
  Adam's m and v 8;
- fp32 and amp (the runtime's bf16/fp16 policy: fp32 parameters that are their own
  master): 4 + 4 + 0 + 8;
- bf16-true and fp16-true (parallel/true16.py): 16-bit parameters and gradients, fp32
  moments, no master: 2 + 2 + 0 + 8 = 12 (seed 004: 84 GB for 7B); optim.bf16_update =
  kahan adds a bf16 compensation per parameter, 2 bytes more, sharded as the optimizer
  state is.
"""

from __future__ import annotations

from shardtrain.config.precision import TRUE16

# bytes per parameter: (params, grads, master, optimizer)
STATE_BYTES = {"bf16": (2, 2, 4, 8), "fp32": (4, 4, 0, 8), "amp": (4, 4, 0, 8),
               "bf16-true": (2, 2, 0, 8), "fp16-true": (2, 2, 0, 8)}
# bytes per gradient element on the wire, by train.grad_reduce_dtype
REDUCE_BYTES = {"fp32": 4, "bf16": 2}


def wire_grad_bytes(precision: str, reduce_dtype: str) -> int:
    """Bytes per gradient element on the wire: `reduce_dtype`'s (train.grad_reduce_dtype);
    "": the precision's gradient bytes, except under bf16-true and fp16-true, whose 16-bit
    gradients are summed in the field's default, fp32 (parallel/precision.py)."""
    if reduce_dtype:
        return REDUCE_BYTES[reduce_dtype]
    return 4 if precision in TRUE16 else STATE_BYTES[precision][1]


def compensation_bytes(bf16_update: str) -> int:
    """Bytes per parameter of optim.bf16_update = kahan's bf16 compensation (0 otherwise)."""
    return 2 if bf16_update == "kahan" else 0
