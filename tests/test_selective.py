"""Selective recomputation and the activation bytes our runtime keeps.

Selective recomputation (the attention core under a checkpoint, Korthikanti et al. 2022
sec. 5) gives the same loss and gradients as none and full; `SavedActivations` measures
what a block keeps for backward; the planner's per-layer figure for our runtime
(plan/activations.py) matches the measurement for llama (GQA) and gpt2, fp32 and bf16
autocast, flash and math SDPA kernels, none / selective / full, and at tp = 2 with and
without sequence parallelism.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dist import run_distributed
from shardtrain.comm import build_mesh
from shardtrain.config import ModelConfig
from shardtrain.mesh import MeshShape
from shardtrain.model.transformer import build_model
from shardtrain.parallel.activation import (SavedActivations, checkpoint_attention_cores,
                                            checkpoint_blocks, saved_bytes_per_block)
from shardtrain.parallel.tensor.layers import apply_tensor_parallel
from shardtrain.plan.activations import runtime_activation_bytes

B, S = 2, 32
MODELS = {
    "llama-gqa": ModelConfig(style="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4,
                             n_kv_heads=2, max_seq_len=S),
    "gpt2": ModelConfig(style="gpt2", vocab_size=256, dim=64, n_layers=2, n_heads=4,
                        max_seq_len=S),
}
MODES = ("none", "selective", "full")


def _recompute(model, mode: str) -> None:
    if mode == "selective":
        assert checkpoint_attention_cores(model.layers) == len(model.layers)
    elif mode == "full":
        checkpoint_blocks(model.layers)


def _rope(model, s: int = S):
    return (model.rope_cos[:s], model.rope_sin[:s]) if model.cfg.style == "llama" else None


def _measure(model, x, precision: str, attention: str) -> int:
    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    with kernel, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
        # the last block: under sp the first one also scatters the model's input
        return saved_bytes_per_block(model.layers[-1], x, _rope(model)).bytes


@pytest.mark.parametrize("name", MODELS)
def test_selective_and_full_give_the_same_loss_and_gradients(name):
    cfg = MODELS[name]
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in MODES:
        model = build_model(cfg, seed=3)
        _recompute(model, mode)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    loss, grads = results["none"]
    for mode in ("selective", "full"):
        torch.testing.assert_close(results[mode][0], loss, rtol=0, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(results[mode][1][n], g, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{mode} {n}: {m}")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "amp"])
@pytest.mark.parametrize("attention", ["flash", "math"])
def test_planner_per_layer_bytes_match_the_runtime(name, precision, attention):
    """Within 10% as the issue asks; today they are equal to the byte."""
    cfg = MODELS[name]
    x = torch.randn(B, S, cfg.dim)
    measured = {}
    for mode in MODES:
        model = build_model(cfg, seed=0)
        _recompute(model, mode)
        measured[mode] = _measure(model, x, precision, attention)
        predicted = runtime_activation_bytes(cfg, s=S, b=B, recompute=mode, precision=precision,
                                             attention=attention)
        assert predicted == pytest.approx(measured[mode], rel=0.10), (mode, measured[mode])
    # full keeps the block input only: the fp32 residual stream under both policies
    assert measured["full"] == B * S * cfg.dim * 4
    # selective drops the core's own state: with flash only the logsumexp (fp32 [B, H, S]),
    # wo keeping the output; with math the probabilities (and k, v repeated to H heads
    # under GQA, q, k, v in fp32 under autocast)
    saved = measured["none"] - measured["selective"]
    if attention == "flash":
        assert saved == 4 * B * cfg.n_heads * S
    else:
        assert saved >= 4 * B * cfg.n_heads * S * S  # at least the fp32 probabilities


def test_meter_counts_storages_once_and_skips_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations(exclude=lin) as meter:
        y = x * x  # x saved twice by one op: one storage
        lin(y[:2])  # a view of y: y's storage, once; the weight excluded
    assert meter.bytes == x.nbytes + y.nbytes
    assert meter.by_dtype == {"float32": x.nbytes + y.nbytes}


def test_cores_that_recompute_already_are_left_alone():
    model = build_model(MODELS["llama-gqa"], seed=0)

    def ring(q, k, v):
        return q

    ring.recomputes_in_backward = True
    model.layers[0].attn.core = ring
    assert checkpoint_attention_cores(model.layers) == 1
    assert model.layers[0].attn.core is ring
    assert checkpoint_attention_cores(model.layers) == 0  # wrapping twice changes nothing


def _tp_bytes(rank: int, world_size: int) -> dict:
    mesh = build_mesh(MeshShape(tp=world_size), rank=rank)
    out = {}
    for name, cfg in MODELS.items():
        x = torch.randn(B, S, cfg.dim, generator=torch.Generator().manual_seed(1))
        for sp in (False, True):
            for precision in ("fp32", "amp"):
                for mode in MODES:
                    model = build_model(cfg, seed=0)
                    apply_tensor_parallel(model, mesh.comm("tp"), sp=sp)
                    _recompute(model, mode)
                    x_in = x.chunk(world_size, 1)[rank] if sp else x
                    out[name, sp, precision, mode] = _measure(model, x_in, precision, "flash")
    return out


def test_planner_per_layer_bytes_match_the_runtime_under_tp():
    t = 2
    results = run_distributed(_tp_bytes, t)
    for (name, sp, precision, mode), measured in results[0].items():
        predicted = runtime_activation_bytes(MODELS[name], s=S, b=B, t=t, sp=sp, recompute=mode,
                                             precision=precision)
        assert predicted == pytest.approx(measured, rel=0.10), (name, sp, precision, mode)
        assert all(r[name, sp, precision, mode] == measured for r in results)


@pytest.mark.parametrize("name", MODELS)
def test_hardware_flops_follow_what_the_runtime_recomputes(name):
    """FlopCounterMode over one forward and backward, SDPA's math kernel (its matmuls are
    counted; CPU flash attention is not): none equals the model FLOPs, selective adds QK^T
    (the early-stopping checkpoint never reruns the product with V, whose output nothing
    saves), full adds each block's forward but its last matmul (w2)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardtrain.cost.counts import hardware_flops_per_token

    cfg = MODELS[name]
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    for mode in MODES:
        model = build_model(cfg, seed=0)
        _recompute(model, mode)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(tokens).sum().backward()
        want = hardware_flops_per_token(cfg, S, mode, attention="math") * B * S
        assert counter.get_total_flops() == want, mode
