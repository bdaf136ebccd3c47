"""GPU check of the mixture-of-experts layer's grouped matmul (`torch._grouped_mm`, CUDA's
grouped GEMM on a GPU: model/moe.py) against the per-expert loop, forward outputs and every
parameter's gradient, in fp32 and under bf16 autocast, dropless and with a capacity.

The CPU twin runs the same model (the CPU's grouped kernel); the CPU suite's tests/test_moe.py
covers the routing and dispatch rules.
"""

from __future__ import annotations

import pytest
import torch

from shardtrain.config import ModelConfig
from test_moe import _model_grads

BOUNDS = {None: 1e-4, torch.bfloat16: 2 ** -6}  # relative to the largest magnitude


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_grouped_matmul_equals_loop(device, autocast, factor):
    base = dict(style="llama", dim=64, n_layers=2, n_heads=4, n_experts=4, moe_top_k=2,
                vocab_size=64, max_seq_len=32, moe_capacity_factor=factor)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 32), generator=gen).to(device)
    out_g, grads_g = _model_grads(ModelConfig(**base, moe_impl="grouped"), tokens, autocast)
    out_l, grads_l = _model_grads(ModelConfig(**base, moe_impl="loop"), tokens, autocast)
    assert grads_g.keys() == grads_l.keys()
    for name, got, want in (("output", out_g, out_l),
                            *((n, grads_g[n], grads_l[n]) for n in grads_g)):
        assert got is not None and got.device.type == device.type, name
        err = (got.float() - want.float()).abs().max().item()
        bound = BOUNDS[autocast] * want.float().abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} over bound {bound:.3e}"
