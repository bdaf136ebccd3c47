"""The planner's roofline (plan/roofline.py): each op at max(FLOPs / (peak x efficiency),
bytes / memory bandwidth); the matmuls carry the hardware FLOPs, the rest their bytes; the
split is reported (pure arithmetic, no torch)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest

from shardtrain.config import load
from shardtrain.cost import hardware
from shardtrain.plan.cli import main
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.layout import Layout
from shardtrain.plan.partition import rank_params
from shardtrain.plan.roofline import roofline_ops

TINY = load("tiny").model
GPT3 = load("gpt3-175b").model
A100 = hardware.get("a100")
MATMULS = {"linears", "attention core"}


def _ops(cfg, layout, hw=A100, *, batch=8, seq=32):
    return {o.name: o for o in roofline_ops(cfg, layout, hw, global_batch=batch, seq_len=seq)}


@pytest.mark.parametrize("layout", [
    Layout(dp=2, micro_batch=2, microbatches=2, precision="fp32"),
    Layout(dp=2, tp=2, sp=True, recompute="selective", micro_batch=1, microbatches=4),
    Layout(dp=1, tp=2, pp=2, recompute="full", attention="math", micro_batch=2,
           microbatches=4, precision="amp"),
])
def test_matmul_flops_are_the_hardware_flops_per_gpu(layout):
    plan = evaluate(TINY, layout, A100, global_batch=8, seq_len=32)
    ops = {o.name: o for o in plan.roof}
    assert sum(ops[n].flops for n in MATMULS) == pytest.approx(
        plan.hardware_flops / layout.gpus, rel=1e-12)
    peak = A100.flops(layout.precision) * A100.efficiency
    for op in plan.roof:  # each op on its roofline, named by the ceiling that set it
        assert op.time_s == max(op.flops / peak, op.bytes / A100.memory_bw)
        assert op.bound == ("compute" if op.flops / peak >= op.bytes / A100.memory_bw
                            else "memory")


def test_gpt3_on_a100_matmuls_compute_bound_the_rest_memory_bound():
    """GPT-3 175B at the seeds' 3D layout: the linears sit an order of magnitude above the
    A100's ridge (312e12 x 0.7 / 2.039e12 = 107 FLOP/byte), every elementwise kind below
    it; the compute-bound part is the FLOPs-only term the planner had before."""
    layout = Layout(dp=32, tp=8, pp=4, zero=1, sp=True, recompute="selective",
                    microbatches=48)
    plan = evaluate(GPT3, layout, A100, global_batch=1536, seq_len=2048)
    ops = {o.name: o for o in plan.roof}
    ridge = 312e12 * 0.7 / 2.039e12
    assert ops["linears"].intensity > 10 * ridge and ops["attention core"].intensity > ridge
    assert {o.name for o in plan.roof if o.bound == "compute"} == MATMULS
    assert {"norms", "residual adds", "activation", "embedding", "loss softmax",
            "optimizer"} == {o.name for o in plan.roof if o.bound == "memory"}
    t = plan.time
    assert t.compute_bound_s == pytest.approx(plan.hardware_flops / (1024 * 312e12 * 0.7))
    assert 0 < t.memory_bound_s < 0.05 * t.compute_bound_s  # fused-free elementwise: ~1%
    assert t.compute_s + t.optimizer_s == pytest.approx(t.compute_bound_s + t.memory_bound_s)


def test_unlimited_memory_bandwidth_is_the_flops_only_model():
    fast = dataclasses.replace(A100, memory_bw=float("inf"))
    layout = Layout(dp=2, micro_batch=2, microbatches=2)
    plan = evaluate(TINY, layout, fast, global_batch=8, seq_len=32)
    peak = A100.peak_flops * A100.efficiency
    assert plan.time.memory_bound_s == 0  # every op at its FLOPs: the matmuls' are the
    # FLOPs-only model's compute term, the elementwise ops' few FLOPs per element add ~2%
    assert sum(o.time_s for o in plan.roof if o.name in MATMULS) == pytest.approx(
        plan.hardware_flops / (2 * peak))
    assert plan.time.compute_s == pytest.approx(
        sum(o.flops for o in plan.roof if o.in_pipeline) / peak)


def test_bytes_of_the_memory_bound_ops():
    """tiny (llama, h = 64, f = 192, V = 256, 2 layers, H = 4, G = 2, D = 16) in fp32 on one
    rank, one micro-batch of 2 x 32 tokens: each kind's bytes by hand."""
    T, h, f, L, V = 64, 64, 192, 2, 256
    ops = _ops(TINY, Layout(micro_batch=2, precision="fp32"), batch=2)
    passes = 3  # forward, backward (twice the forward's traffic)
    # two norms per block (read x, write y) and the final one, fp32
    assert ops["norms"].bytes == (2 * L * passes + passes) * T * h * 2 * 4
    assert ops["residual adds"].bytes == 2 * L * passes * T * h * 3 * 4  # read 2, write 1
    assert ops["activation"].bytes == L * passes * T * f * 3 * 4  # SwiGLU: gate, up -> out
    assert ops["rotary"].bytes == L * passes * T * (4 + 2) * 16 * 2 * 4  # q and k heads
    assert ops["embedding"].bytes == passes * T * h * 2 * 4
    assert ops["loss softmax"].bytes == 2 * T * V * (4 + 4)  # logits in, fp32 log-probs out
    assert "softmax" not in ops  # the flash kernel fuses the attention softmax
    n = rank_params(TINY, Layout()).total
    assert ops["optimizer"].bytes == 28 * n  # AdamW fp32: read g, p, m, v; write p, m, v


def test_layout_moves_the_memory_bound_terms():
    base = Layout(dp=2, tp=2, micro_batch=2, microbatches=2)
    ops = _ops(TINY, base)
    # sp: the residual-width ops run on T / tp tokens
    assert _ops(TINY, dataclasses.replace(base, sp=True))["norms"].bytes == pytest.approx(
        ops["norms"].bytes / 2)
    # full recomputation reruns the block's forward: 4 passes instead of 3
    assert _ops(TINY, dataclasses.replace(base, recompute="full"))["activation"].bytes == \
        pytest.approx(ops["activation"].bytes * 4 / 3)
    # the math kernel's softmax over [b, H/t, s, s] is a term of its own: passes x layers x
    # micro-batches x (T x H/t x s) x (read + write) x 2 bytes
    math = _ops(TINY, dataclasses.replace(base, attention="math"))
    assert math["softmax"].bytes == 3 * 2 * 2 * (64 * 2 * 32) * 2 * 2 and \
        math["softmax"].bound == "memory"
    # ZeRO-1 steps a 1/dp shard; under offload the host steps it (no device term)
    assert _ops(TINY, dataclasses.replace(base, zero=1))["optimizer"].bytes == pytest.approx(
        ops["optimizer"].bytes / 2)
    assert "optimizer" not in _ops(TINY, dataclasses.replace(base, zero=1, offload="cpu"))


def test_small_micro_batches_make_the_linears_memory_bound():
    """Seed 002 section 5.3: larger batches make compute more efficient. A linear's
    intensity grows with the tokens per micro-batch: on an H100 (ridge 989e12 x 0.7 /
    3.35e12 = 207 FLOP/byte) Llama-3 8B's linears are memory-bound at 128 tokens and
    compute-bound at 8,192."""
    cfg, h100 = load("llama3-8b").model, hardware.get("h100")
    short = _ops(cfg, Layout(micro_batch=1), h100, batch=1, seq=128)["linears"]
    long = _ops(cfg, Layout(micro_batch=1), h100, batch=1, seq=8192)["linears"]
    assert short.bound == "memory" and short.intensity < 207 < long.intensity
    assert long.bound == "compute"


def test_plan_reports_the_split():
    argv = ["--model", "tiny", "--gpus", "2", "--gpu", "a100", "--global-batch", "8",
            "--layout", "dp=2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    assert "roofline per step" in text and "memory-bound" in text and "loss softmax" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--json"]) == 0
    doc = json.loads(out.getvalue())
    assert {"compute_bound_s", "memory_bound_s", "optimizer_s"} <= set(doc["time"])
    assert {op["name"] for op in doc["roofline"]} >= MATMULS | {"norms", "optimizer"}
    assert all(op["bound"] in ("compute", "memory") for op in doc["roofline"])
