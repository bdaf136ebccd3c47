"""GPU checks of context parallelism's attention (issue 15): ring attention forward and
backward against dense SDPA on one GPU in bf16, the cp ranks simulated over chunks in one
process (`simulated_ring_attention` runs the very same per-block math), and its speed
against dense SDPA at the same total length (printed, not asserted).

Run where CUDA exists: `python -m pytest tests/gpu -q -s`. Elsewhere every test is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtrain.parallel.context import SequenceSplit, simulated_ring_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these checks run attention on a GPU")


def _inputs(b: int, h: int, g: int, s: int, d: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, m, s, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for m in (h, g, g)]  # q [B, H, S, D], k and v [B, G, S, D]


def _dense(q, k, v, causal: bool):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_dense_sdpa_in_bf16(cp, causal):
    """Outputs and input gradients within the CPU suite's bf16 bound (2^-6 of the largest
    magnitude): the reference is dense attention in fp32 on the same bf16 inputs."""
    q, k, v = _inputs(2, 8, 2, 1024, 64, torch.bfloat16)
    split = SequenceSplit(1024, cp, zigzag=True)
    out = simulated_ring_attention(q, k, v, split=split, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _dense(q32, k32, v32, causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), torch.ones_like(ref))
    for name, got, want in (("out", out, ref), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        bound = 2 ** -6 * want.abs().max().item()
        err = (got.float() - want).abs().max().item()
        print(f"cp={cp} causal={causal} {name}: max error {err:.3e} (bound {bound:.3e})")
        assert err <= bound, name


def test_ring_speed_against_dense_sdpa():
    """Forward + backward time of the simulated ring (cp=4, every rank's blocks run in
    turn on the one GPU) against dense SDPA (flash) at the same total length."""
    q, k, v = _inputs(1, 16, 4, 8192, 128, torch.bfloat16)
    split = SequenceSplit(8192, 4, zigzag=True)

    def timed(fn) -> float:
        for _ in range(2):
            fn().sum().backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn().sum().backward()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 5

    dense = timed(lambda: _dense(q, k, v, True))
    ring = timed(lambda: simulated_ring_attention(q, k, v, split=split, causal=True))
    print(f"S=8192 H=16 G=4 D=128 bf16 causal, forward+backward: dense SDPA {dense:.2f} ms, "
          f"simulated ring cp=4 (all ranks on one GPU) {ring:.2f} ms, ratio {ring / dense:.2f}")
    assert ring > 0 and dense > 0
