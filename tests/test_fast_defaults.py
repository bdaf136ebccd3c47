"""The defaults that differ on a GPU (docs/precision.md, "Defaults"), checked on a CPU: bf16
where the GPU computes in it (else fp32, in TF32), grouped-query attention in a kernel that
keeps no [B, H, S, S] scores, fused AdamW; and the CPU run unchanged (fp32, foreach)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardtrain import config
from shardtrain.config import OptimConfig
from shardtrain.model import sdpa_kernels
from shardtrain.model.attention import sdpa_core
from shardtrain.model.sdpa_kernels import attention_kernel, repeats_kv
from shardtrain.train.optim import adamw_kernel, build_optimizer
from shardtrain.train.start.device import device_defaults


@pytest.fixture
def tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("device, bf16, want", [("cpu", True, "fp32"), ("cuda", True, "bf16"),
                                                ("cuda", False, "fp32")])
def test_precision_auto_is_the_devices_default(device, bf16, want, monkeypatch, tf32):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: bf16
                        and not including_emulation)  # native only: emulated bf16 is slow
    cfg = config.load("default")
    assert cfg.train.precision == "auto"
    torch.backends.cuda.matmul.allow_tf32 = False
    device_defaults(cfg, device)
    assert cfg.train.precision == want
    assert torch.backends.cuda.matmul.allow_tf32 == (device == "cuda")  # fp32 matmuls: TF32
    device_defaults(cfg, device)  # idempotent
    assert cfg.train.precision == want and "precision = " + repr(want).replace(
        "'", '"') in config.to_toml(cfg)


def test_a_chosen_precision_and_tf32_off_are_kept_on_a_gpu(monkeypatch, tf32):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    cfg = config.load("tiny", ["--train.precision", "fp32", "--train.tf32", "false"])
    torch.backends.cuda.matmul.allow_tf32 = True
    device_defaults(cfg, "cuda")
    assert cfg.train.precision == "fp32" and not torch.backends.cuda.matmul.allow_tf32


def test_gqa_takes_a_fused_kernel_where_sdpa_has_one():
    """CPU flash takes GQA in any dtype; on CUDA flash (16-bit) does, the memory-efficient
    kernel (fp32, heads over 256) gets the kv heads repeated; tests/test_attention_kernels.py
    checks the dispatch."""
    assert attention_kernel("cpu", "float32", 64) == "flash"
    assert not repeats_kv("flash", "cpu")
    assert attention_kernel("cuda", "bfloat16", 128) == "flash"
    assert not repeats_kv("flash", "cuda")
    assert attention_kernel("cuda", "float32", 128) == "efficient"
    assert attention_kernel("cuda", "bfloat16", 512) == "efficient"
    assert repeats_kv("efficient", "cuda")


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_gqa_without_a_fused_kernel_keeps_no_scores_and_the_same_numbers(monkeypatch):
    """What CUDA runs for fp32 GQA, on a CPU: the kv heads repeated, then a fused kernel.
    The math kernel (CUDA's choice for fp32 GQA before) keeps [B, H, S, S] scores."""
    b, h, g, s, d = 2, 8, 2, 64, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, requires_grad=True) for n in (h, g, g))
    scores = b * h * s * s

    def reference():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with sdpa_kernel(SDPBackend.MATH):
        assert max(torch.Size(x).numel() for x in _saved_shapes(reference)) >= scores
    want = reference()
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    monkeypatch.setattr(sdpa_kernels, "repeats_kv", lambda *args, **kwargs: True)
    out: list[torch.Tensor] = []
    shapes = _saved_shapes(lambda: out.append(sdpa_core(q, k, v)))
    assert max(torch.Size(x).numel() for x in shapes) < scores, shapes
    torch.testing.assert_close(out[0], want)
    for got, ref in zip(torch.autograd.grad(out[0].square().sum(), (q, k, v)), want_grads):
        torch.testing.assert_close(got, ref)


def test_adamw_is_fused_on_a_gpu_and_torchs_default_on_a_cpu():
    on_gpu = [SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=True)]
    assert adamw_kernel(on_gpu) == {"fused": True}
    assert adamw_kernel([SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)]) == {}
    optimizer = build_optimizer(torch.nn.Linear(4, 4), OptimConfig(), lr=1e-3)
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"] is None
