"""Part 1 of the GPU check: what this machine and its torch offer.

    python benchmarks/gpu/probe.py --device cuda --rows ROWS.jsonl

Rows: the versions (Python, torch, CUDA, cuDNN, NCCL, Triton, and the optional packages
shardtrain or the check can use); the device (name, capability, multiprocessors, memory
total and free, bf16, the fp32 matmul precision); the backends torch.distributed has and the
collective names the communicator picks between (comm/communicator.py); then one row per
kernel the training step relies on, tried on small inputs: each SDPA backend in bf16 and
fp32 with grouped-query heads (the presets' shape), the grouped matmul of MoE in bf16 and
fp32, fused AdamW. Such a row says whether the kernel is available, and if not torch's
reason: a finding, not a failure of the check (flash takes no fp32, for one).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import MIB, error_line, part_main

OPTIONAL = ("numpy", "tokenizers", "safetensors", "tqdm", "datasets", "transformers", "peft",
            "triton", "tensorboard", "matplotlib")


def versions() -> dict:
    """Each package's version, None where it cannot be imported (shardtrain imports every
    optional one lazily, where a feature needs it)."""
    found = {}
    for name in OPTIONAL:
        try:
            found[name] = importlib.metadata.version(name) \
                if importlib.util.find_spec(name) is not None else None
        except importlib.metadata.PackageNotFoundError:
            found[name] = "no metadata"
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, **found}


def device_row(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"model": platform.processor() or "cpu", "threads": torch.get_num_threads()}
    p = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"model": p.name, "capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count, "total_mib": total / MIB,
            "free_mib": free / MIB, "bf16": torch.cuda.is_bf16_supported(),
            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_tf32": torch.backends.cudnn.allow_tf32}


def collectives() -> dict:
    return {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
            "all_gather_single": hasattr(dist, "all_gather_single"),
            "reduce_scatter_single": hasattr(dist, "reduce_scatter_single"),
            "all_gather_into_tensor": hasattr(dist, "all_gather_into_tensor")}


def sdpa(device: torch.device, backend: str, dtype: torch.dtype) -> dict:
    """One forward and backward of SDPA forced onto `backend`, GQA shaped (8 query heads,
    2 kv heads), causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, h, 256, 64, device=device, dtype=dtype, requires_grad=True)
               for h in (8, 2, 2))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    return {"out": str(out.dtype).removeprefix("torch.")}


def grouped_mm(device: torch.device, dtype: torch.dtype) -> dict:
    """MoE's grouped matmul (model/moe.py `_grouped`): 4 groups of rows times 4 weights."""
    x = torch.randn(64, 128, device=device, dtype=dtype)
    w = torch.randn(4, 256, 128, device=device, dtype=dtype)
    offs = torch.tensor([16, 32, 48, 64], device=device, dtype=torch.int32)
    out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(out[16:32].float(), (x[16:32] @ w[1].T).float(),
                               rtol=2e-2, atol=2e-2)
    return {}


def fused_adamw(device: torch.device) -> dict:
    p = torch.nn.Parameter(torch.randn(1024, device=device))
    p.grad = torch.randn_like(p)
    torch.optim.AdamW([p], lr=1e-3, fused=True).step()
    return {}


def available(kernel) -> dict:
    """Whether `kernel()` runs here, and torch's reason where it does not."""
    try:
        return {"available": True, **kernel()}
    except Exception as e:  # noqa: BLE001 -- a refusal is what the row reports
        return {"available": False, "reason": error_line(e)}


def main() -> None:
    device, rows, _ = part_main(__doc__, "probe")
    rows.guarded("versions", versions)
    rows.guarded(f"device {device.type}", lambda: device_row(device))
    rows.guarded("collectives", collectives)
    backends = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH") \
        if device.type == "cuda" else ("FLASH_ATTENTION", "MATH")
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for backend in backends:
            rows.guarded(f"sdpa {backend.lower()} {name} gqa",
                         lambda: available(lambda: sdpa(device, backend, dtype)))
        rows.guarded(f"grouped_mm {name}", lambda: available(lambda: grouped_mm(device, dtype)))
    rows.guarded("fused adamw", lambda: available(lambda: fused_adamw(device)))


if __name__ == "__main__":
    main()
