"""The planner's mixture-of-experts and expert-parallel figures follow the runtime.

- Partition: experts are whole on every tensor-parallel rank and split over ep.
- Traffic: the ep all-to-alls per step hand-computed (counts, dispatch, combine; full
  recomputation's reruns; a capacity factor's bound); against the ledger of real runs:
  tests/test_plan_ep_ledger.py.
- Search: an MoE model gets ep > 1 candidates when the trainer accepts them (every ranked
  layout passing config validation, MoE models included: tests/test_plan_runs.py).
- Reporting: a layout that does not fit, and a model that fits nowhere, still print the
  document (fits: false, reason, memory, traffic, time).
"""

from __future__ import annotations

import json

import pytest

from shardtrain.config import ModelConfig
from shardtrain.cost import hardware
from shardtrain.plan.layout import Layout, trainer_refusal
from shardtrain.plan.partition import rank_params
from shardtrain.plan.search import candidates
from shardtrain.plan.traffic import expert_parallel_ops, routed_slots, step_ops
from tests.test_plan import run_cli

MOE = ModelConfig(style="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=64, n_experts=4, moe_top_k=2)


# ---------------------------------------------------------------- partition and traffic


def test_experts_replicated_over_tp_split_over_ep():
    expert_layer = 4 * 3 * 64 * MOE.ffn_hidden  # E x SwiGLU (3 h f)
    for tp, ep in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 4)):
        ranks = rank_params(MOE, Layout(dp=4, tp=tp, ep=ep))
        assert ranks.expert == 2 * expert_layer / ep, (tp, ep)
    whole, split = rank_params(MOE, Layout()), rank_params(MOE, Layout(tp=2, dp=2, ep=2))
    assert split.dense == pytest.approx(whole.dense / 2)


@pytest.mark.parametrize("precision,recompute,sp,factor,calls,slots,out_b,back_b", [
    # T = b s = 2 x 32 tokens, K = T k = 128 slots, C = 64; L = 2 layers x m = 3 micro-batches
    ("fp32", "none", False, 0.0, (6, 12, 12), 128, 4, 4),
    ("fp32", "selective", False, 0.0, (6, 12, 12), 128, 4, 4),  # the attention core only
    ("fp32", "full", False, 0.0, (12, 18, 18), 128, 4, 4),  # the forward's three rerun
    ("amp", "none", False, 0.0, (6, 12, 12), 128, 4, 2),  # normed input fp32, experts bf16
    ("bf16", "none", True, 0.0, (6, 12, 12), 64, 2, 2),  # sp: each tp rank routes T / 2
    ("fp32", "none", False, 0.5, (6, 12, 12), 64, 4, 4),  # capacity E ceil(0.5 K / E) = 64
    ("fp32", "none", False, 2.0, (6, 12, 12), 128, 4, 4),  # a loose capacity drops nothing
])
def test_ep_ops_hand_computed(precision, recompute, sp, factor, calls, slots, out_b, back_b):
    cfg = ModelConfig(**{**MOE.__dict__, "moe_capacity_factor": factor})
    lay = Layout(dp=4, tp=2 if sp else 1, sp=sp, ep=2, precision=precision,
                 recompute=recompute, micro_batch=2, microbatches=3)
    assert routed_slots(cfg, lay, seq_len=32) == slots
    counts, out, back = expert_parallel_ops(cfg, lay, seq_len=32)
    assert (counts.what, out.what, back.what) == ("counts", "dispatch", "combine")
    assert (counts.calls, out.calls, back.calls) == calls
    # the ledger's native all_to_all: (n - 1) / n of the input, n = ep = 2
    assert counts.bytes_sent == calls[0] * 4 * 8 / 2
    assert out.bytes_sent == calls[1] * slots * 64 * out_b / 2
    assert back.bytes_sent == calls[2] * slots * 64 * back_b / 2
    placed = [op for op in step_ops(cfg, lay, hardware.get("h100"), seq_len=32)
              if op.group == "ep"]  # the same ops, timed on the ep group's link
    assert [(op.what, op.calls, op.bytes_sent) for op in placed] == [
        (op.what, op.calls, op.bytes_sent) for op in (counts, out, back)]
    assert all(op.time_s > 0 for op in placed)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_moe_activation_bytes_match_the_runtime(style, precision):
    """One process, every recompute mode and a few (E, k): what an MoE block keeps for
    backward equals the planner's per-layer figure to the byte (ep = 2 is checked, summed
    over the ranks, in test_plan_ep_ledger.py)."""
    import torch

    from shardtrain.model.transformer import build_model
    from shardtrain.parallel.activation import (checkpoint_attention_cores, checkpoint_blocks,
                                                saved_bytes_per_block)
    from shardtrain.plan.activations import runtime_activation_bytes

    for experts, k, b, s, shape in ((4, 2, 2, 32, {}), (8, 1, 2, 32, {}), (8, 3, 1, 64, {}),
                                    (8, 2, 2, 32, {"moe_ffn_dim": 40, "moe_shared_experts": 2})):
        cfg = ModelConfig(**{**MOE.__dict__, "style": style, "n_experts": experts,
                             "moe_top_k": k, "n_kv_heads": 0, **shape})
        for mode in ("none", "selective", "full"):
            model = build_model(cfg, seed=0)
            if mode == "selective":
                checkpoint_attention_cores(model.layers)
            elif mode == "full":
                checkpoint_blocks(model.layers)
            rope = (model.rope_cos[:s], model.rope_sin[:s]) if style == "llama" else None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
                measured = saved_bytes_per_block(model.layers[-1], torch.randn(b, s, cfg.dim),
                                                 rope).bytes
            predicted = runtime_activation_bytes(cfg, s=s, b=b, recompute=mode,
                                                 precision=precision)
            assert predicted == measured, (experts, k, b, s, mode)


def test_no_ep_ops_without_ep():
    assert expert_parallel_ops(MOE, Layout(dp=2), seq_len=32) == []
    assert not [op for op in step_ops(MOE, Layout(dp=2), hardware.get("h100"), seq_len=32)
                if op.group == "ep"]


# ---------------------------------------------------------------- search and validation


def test_moe_candidates_include_ep_when_the_trainer_accepts_it():
    """Whatever the trainer composes ep with today, an MoE model on dp x cp >= 2 gets an
    ep > 1 candidate, and every candidate passes validation (ep included)."""
    for gpus in (2, 4, 8):
        seen = [lay for lay in candidates(MOE, gpus=gpus, node_size=8, global_batch=8,
                                          seq_len=32, precision="fp32")]
        assert seen and all(trainer_refusal(lay, MOE, seq_len=32) is None for lay in seen)
        assert any(lay.ep > 1 for lay in seen), gpus
        assert {lay.ep for lay in seen} <= {1, 2, 4}
    dense = ModelConfig(**{**MOE.__dict__, "n_experts": 0})
    assert all(lay.ep == 1 for lay in candidates(dense, gpus=4, node_size=8, global_batch=8,
                                                 seq_len=32, precision="fp32"))


# ---------------------------------------------------------------- reporting what does not fit


def test_a_layout_that_does_not_fit_is_still_reported():
    code, out, err = run_cli(["--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100",
                              "--layout", "dp=1,tp=8,pp=1", "--json"])
    assert code == 2 and "GB more than the" in err
    doc = json.loads(out)
    assert doc["fits"] is False and "GB more than the" in doc["reason"]
    assert doc["memory_per_gpu_bytes"]["activations_per_layer"] > 0
    assert doc["memory_per_gpu_bytes"]["total"] > doc["memory_per_gpu_bytes"]["usable"]
    assert doc["comm"]["bytes_per_step"]["tp"] and doc["time"]["step_s"] > 0
    assert doc["model"]["params"] > 1.7e11 and doc["trainer_refuses"] is None


def test_a_model_that_fits_nowhere_is_still_reported():
    # On 8 GPUs it now fits with nvme offload (ZeRO-Infinity: 101 GB of gradient buffers per
    # GPU in host memory); on 4, the node's host memory per GPU is too small for them.
    code, out, err = run_cli(["--model", "llama3-405b", "--gpus", "4", "--gpu", "a100-40gb",
                              "--json"])
    assert code == 2 and "fits nowhere" in err and "host memory" in err
    doc = json.loads(out)
    assert doc["fits"] is False and doc["ranked"] == [] and "fits nowhere" in doc["reason"]
    assert doc["rejected"] and doc["search"]["rejected_total"] > 0
    # the closest layout, evaluated in full
    assert doc["layout"]["text"] == doc["rejected"][0]["layout"]["text"]
    assert doc["memory_per_gpu_bytes"]["fits"] is False and doc["time"]["step_s"] > 0
    code, out, err = run_cli(["--model", "llama3-405b", "--gpus", "4", "--gpu", "a100-40gb"])
    assert code == 2 and "closest:" in out and "memory per GPU" in out


def test_a_layout_the_trainer_refuses_says_so():
    """The planner's own checks let pp x v = 12 <= 32 layers through; the trainer wants
    equal chunks (config.check_pipeline), and the report carries its message."""
    code, out, _ = run_cli(["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--seq",
                            "1024", "--layout", "dp=16,pp=4,v=3,schedule=interleaved,"
                            "microbatches=16,recompute=full", "--json"])
    doc = json.loads(out)
    assert code == (0 if doc["fits"] else 2)
    assert "parallel.virtual_stages=3" in doc["trainer_refuses"]
