"""Which kernel torch's scaled-dot-product attention runs a causal call on, without a mask:
the one rule the runtime (model/attention.py, parallel/context/ulysses.py) and the planner
(plan/layout.py's `attention` field) share. Torch-free, so the planner imports it cheaply.

SDPA picks among the kernels that take its inputs, flash first, then memory-efficient,
then math; math materialises the [B, H, S, S] scores. Dtypes by torch's names (float32,
bfloat16, float16, float64).
"""

from __future__ import annotations

KERNELS = ("flash", "efficient", "math")
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def attention_kernel(device_type: str, dtype: str, head_dim: int) -> str:
    """CPU: its flash kernel, any float dtype, grouped kv heads included. CUDA: flash for
    16-bit inputs with head dims up to 256 in steps of 8; the memory-efficient kernel for
    fp32 (flash takes only 16 bits) and larger heads, its head dim a multiple of its 16-byte
    alignment (4 fp32 or 8 16-bit elements); math otherwise."""
    if device_type != "cuda":
        return "flash"
    size = _BYTES.get(dtype)
    if size == 2 and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    if size and head_dim % (16 // size) == 0:
        return "efficient"
    return "math"


def repeats_kv(kernel: str, device_type: str) -> bool:
    """Whether grouped kv heads are repeated to the query heads for `kernel`: CUDA's
    memory-efficient kernel takes no GQA (flash, CPU's flash and math take enable_gqa)."""
    return device_type == "cuda" and kernel == "efficient"
