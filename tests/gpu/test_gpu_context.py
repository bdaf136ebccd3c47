"""GPU checks of context parallelism's attention (issues 15, 30): ring attention forward and
backward against dense SDPA on one device, the cp ranks simulated over chunks in one process
(`simulated_ring_attention` runs the very same per-block math), in bf16 (CUDA's flash
kernel per chunk pair) and fp32 (CUDA's memory-efficient kernel, whose log-sum-exp rows come
padded to a multiple of 32: parallel/context/blocks.py), at chunk lengths that are not a
multiple of 32; and its speed against dense SDPA at the same total length (printed, not
asserted).

Sizes per device: on a GPU sequences of 1000 tokens (chunks of 250 and 125); the CPU twin
(CPU's flash kernel, any dtype) 40 tokens (chunks of 10 and 5).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from shardtrain.parallel.context import SequenceSplit, simulated_ring_attention

# device -> (batch, query heads, kv heads, sequence, head dim) of the accuracy checks
SHAPES = {"cuda": (2, 8, 2, 1000, 64), "cpu": (1, 4, 2, 40, 16)}
SPEED = {"cuda": (1, 16, 4, 8192, 128), "cpu": (1, 4, 2, 64, 16)}  # of the speed check
# Error bounds, relative to the largest magnitude of the fp64 reference: bf16's 8-bit
# mantissa (the CPU suite's bound); for fp32 a GPU's kernels may round their products to
# TF32 (10 bits): 2^-8 allows it, far below the O(1) errors of misread padded lse rows.
BOUNDS = {torch.bfloat16: 2 ** -6, torch.float32: 2 ** -8}


def _inputs(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype):
    b, h, g, s, d = shape
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(b, m, s, d, device=device, dtype=dtype, generator=gen).requires_grad_()
            for m in (h, g, g)]  # q [B, H, S, D], k and v [B, G, S, D]


def _dense(q, k, v, causal: bool):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_dense_sdpa(device, dtype, cp, causal):
    """Outputs and input gradients: the reference is dense attention in fp64 (SDPA's math
    kernel) on the same inputs."""
    q, k, v = _inputs(device, SHAPES[device.type], dtype)
    seq = q.shape[2]
    split = SequenceSplit(seq, cp, zigzag=True)
    assert (seq // (2 * cp)) % 32, "a chunk length that is not a multiple of 32"
    out = simulated_ring_attention(q, k, v, split=split, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    wide = torch.float64
    q32, k32, v32 = (t.detach().to(wide).requires_grad_() for t in (q, k, v))
    ref = _dense(q32, k32, v32, causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), torch.ones_like(ref))
    for name, got, want in (("out", out, ref), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        bound = BOUNDS[dtype] * want.abs().max().item()
        err = (got.to(wide) - want).abs().max().item()
        print(f"{dtype} cp={cp} causal={causal} {name}: max error {err:.3e} (bound {bound:.3e})")
        assert err <= bound, name


def test_ring_speed_against_dense_sdpa(device, record_property):
    """Forward + backward time of the simulated ring (cp=4, every rank's blocks run in
    turn on the one device) against dense SDPA at the same total length, in bf16."""
    q, k, v = _inputs(device, SPEED[device.type], torch.bfloat16)
    split = SequenceSplit(q.shape[2], 4, zigzag=True)

    def timed(fn) -> float:
        for _ in range(2):
            fn().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5 * 1e3

    dense = timed(lambda: _dense(q, k, v, True))
    ring = timed(lambda: simulated_ring_attention(q, k, v, split=split, causal=True))
    print(f"{tuple(q.shape)} bf16 causal on {device.type}, forward+backward: dense SDPA "
          f"{dense:.2f} ms, simulated ring cp=4 (all ranks on one device) {ring:.2f} ms, "
          f"ratio {ring / dense:.2f}")
    record_property("dense_ms", dense)  # the GPU check's table (benchmarks/gpu/report.py)
    record_property("ring_ms", ring)
    assert ring > 0 and dense > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_documents_on_the_device_kernels(device, dtype):
    """Packed documents (issue 43) on the device's kernels: the per-document core and the
    simulated ring at cp=4 (its per-document cuts of chunk pairs: blocks of unequal query
    and key lengths) against each document alone in fp64; on CUDA every SDPA call a fused
    kernel (flash or cuDNN in bf16, memory-efficient with kv repeated in fp32), none math."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardtrain.model.attention import sdpa_core
    from shardtrain.model.positions import Documents

    q, k, v = _inputs(device, SHAPES[device.type], dtype)
    seq = q.shape[2]
    lengths = [seq // 3, seq // 2, 1, seq - seq // 3 - seq // 2 - 1]
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(q.shape[0], -1)
    docs = Documents.from_positions(positions)
    wide = [t.detach().double() for t in (q, k, v)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ref = torch.cat([_dense(*(t[:, :, a:a + n] for t in wide), True)
                     for a, n in zip(starts, lengths)], dim=2)

    class Ops(TorchDispatchMode):
        names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        out = sdpa_core(q, k, v, docs)
    fused = [n for n in ops.names if "scaled_dot_product" in n]  # one per document and row
    assert len(fused) == len(lengths) * q.shape[0], fused
    assert not [n for n in ops.names if "bmm" in n or "matmul" in n], ops.names
    ring = simulated_ring_attention(q, k, v, split=SequenceSplit(seq, 4, True), documents=docs)
    for name, got in (("per document", out), ("ring cp=4", ring)):
        err = (got.double() - ref).abs().max().item()
        bound = BOUNDS[dtype] * ref.abs().max().item()
        print(f"{dtype} documents {name}: max error {err:.3e} (bound {bound:.3e})")
        assert err <= bound, name
