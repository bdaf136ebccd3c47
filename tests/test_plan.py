"""Planner acceptance: the seeds' numbers, the search command, the JSON document and the
bad-input messages (shardtrain.plan; no torch except the built-model comparison)."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from shardtrain.cost.collectives import cost
from shardtrain.cost.link import Link
from shardtrain.config import load
from shardtrain.plan.cli import main
from shardtrain.plan.closed_form import narayanan_params, training_flops
from shardtrain.cost.counts import param_counts
from shardtrain.plan.layout import Layout, check
from shardtrain.plan.closed_form import activation_bytes_per_layer
from shardtrain.plan.memory import memory_per_gpu, model_states
from shardtrain.plan.timing import bubble_fraction, gpus_for_deadline, training_seconds

GB = 1e9
MiB = 2 ** 20
GPT3 = load("gpt3-175b").model
SEARCH = ["--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100", "--gpus-per-node", "8"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_gpt3_parameter_count_exact_and_closed_form():
    total = param_counts(GPT3).total
    assert total == 174_604_259_328
    assert abs(total - 175e9) / 175e9 < 0.003
    # Narayanan et al. 2021 omit the final LayerNorm (2h); otherwise identical.
    assert narayanan_params(GPT3) == pytest.approx(total - 2 * GPT3.dim, abs=1e-3)


def test_counts_equal_the_built_model():
    torch = pytest.importorskip("torch")
    from shardtrain.model.transformer import build_model
    for preset in ("tiny", "gpt3-175b"):
        cfg = load(preset).model
        with torch.device("meta"):
            model = build_model(cfg, seed=None)
        assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total


def test_training_flops_6nd_seed_000():
    assert training_flops(175e9, 300e9) == pytest.approx(3.15e23)
    assert f"{training_flops(param_counts(GPT3).total, 300e9):.2e}" == "3.14e+23"
    assert training_flops(175e9, 300e9, recompute="full") == pytest.approx(4.2e23)


def test_gpus_for_30_days_at_160_tflops_seeds_000_004():
    # seed 001/000: 6 x 175B x 300B / 160 TFLOP/s / (3600 x 24 x 30 s) "= 800" (rounded).
    n = gpus_for_deadline(training_flops(175e9, 300e9), seconds=30 * 86400,
                          flops_per_gpu=160e12)
    assert n == 760
    assert abs(n - 800) / 800 <= 0.05


def test_training_time_rule_of_thumb():
    # Narayanan et al. 2021: GPT-3 (175B, 300B tokens) on 1024 A100s at 140 TFLOP/s, full
    # recomputation: 8TP/(nX) ~ 34 days.
    seconds = training_seconds(training_flops(175e9, 300e9, recompute="full"), gpus=1024,
                               flops_per_gpu=140e12)
    assert round(seconds / 86400) == 34


def test_static_memory_175b_over_2_8_tb():
    states = model_states(175e9)  # mixed-precision Adam, 16 bytes per parameter
    assert states.params + states.grads == pytest.approx(700e9)  # "~700 GB"
    assert states.master + states.optimizer == pytest.approx(2.1e12)  # "~2.1 TB"
    assert states.total == pytest.approx(2.8e12)
    exact = model_states(param_counts(GPT3).total).total
    one_sequence = memory_per_gpu(GPT3, Layout(), seq_len=2048)
    assert exact + one_sequence.activations > 2.8e12  # "Total: > 2.8 TB"


@pytest.mark.parametrize("zero,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_table_7_5b_on_64_gpus(zero, expected_gb):
    states = model_states(7.5e9, nd=64, zero=zero)
    assert round(states.total / GB, 1) == expected_gb


def test_zero_table_10b_on_8_workers_seed_003():
    gb = {z: model_states(10e9, nd=8, zero=z) for z in range(4)}
    assert [round(gb[z].total / GB, 1) for z in range(4)] == [160, 55, 37.5, 20]
    dp = gb[0]
    assert (dp.params, dp.grads, dp.master, dp.optimizer) == (20 * GB, 20 * GB, 40 * GB, 80 * GB)
    assert gb[1].master + gb[1].optimizer == pytest.approx(15 * GB)  # "optimizer shard 15 GB"
    assert gb[2].grads == pytest.approx(2.5 * GB) and gb[3].params == pytest.approx(2.5 * GB)


def _bandwidth_bound(nbytes: float, bandwidth: float) -> float:
    link = Link.from_bandwidth(bytes_per_s=bandwidth, latency_s=0.0)
    return cost("all_reduce", nbytes, 8, link, algorithm="ring").time_s


def test_ring_all_reduce_bounds_seed_003():
    # Exercise: 64 MiB of bf16 gradients on 8 workers: 2 (p-1)/p x 64 MiB = 112 MiB each.
    link = Link.from_bandwidth(bytes_per_s=900e9, latency_s=0.0)
    assert cost("all_reduce", 64 * MiB, 8, link, algorithm="ring").sent_bytes == 112 * MiB
    assert _bandwidth_bound(64 * MiB, 900e9) == pytest.approx(0.1305e-3, rel=1e-3)
    assert _bandwidth_bound(64 * MiB, 50e9) == pytest.approx(2.349e-3, rel=1e-3)
    # Key Result: a 25 MiB bucket on 8 workers: "about 0.051 ms" and "about 0.92 ms".
    assert round(_bandwidth_bound(25 * MiB, 900e9) * 1e3, 3) == 0.051
    assert round(_bandwidth_bound(25 * MiB, 50e9) * 1e3, 2) == 0.92
    # 1B parameters, a 2 GB bf16 gradient: "about 3.9 ms" at 900 GB/s, "near 70 ms" at 50 GB/s.
    assert round(_bandwidth_bound(2e9, 900e9) * 1e3, 1) == 3.9
    assert round(_bandwidth_bound(2e9, 50e9) * 1e3) == 70


def test_bubble_p4_m8_seed_004():
    # The seed's 37.5% is (p-1)/m: bubble time over ideal time. As a fraction of the step
    # (FORMULAS.md's bubble_fraction) it is (p-1)/(m+p-1) = 3/11.
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    code, out, _ = run_cli(["--model", "tiny", "--model.n_layers", "8", "--gpus", "4", "--gpu",
                            "cpu", "--global-batch", "8", "--seq", "32", "--layout",
                            "dp=1,pp=4,microbatches=8", "--json"])
    assert code == 0
    time_doc = json.loads(out)["time"]
    assert time_doc["bubble_fraction"] == pytest.approx(3 / 11)
    assert time_doc["bubble_ratio"] == pytest.approx(0.375)


def test_3d_layout_175b_on_1024_gpus_seed_004():
    layout = Layout(dp=32, tp=8, pp=4, micro_batch=1, microbatches=48)
    check(layout, GPT3, gpus=1024, node_size=8, global_batch=1536, seq_len=2048)
    memory = memory_per_gpu(GPT3, layout, seq_len=2048)
    # 175B x 2 bytes / (t x p) on the busiest stage (which also holds the embedding).
    assert memory.params == pytest.approx(2 * 175e9 / 32, rel=0.02)
    sharded = memory_per_gpu(GPT3, Layout(dp=32, tp=8, pp=4, zero=3, micro_batch=1,
                                          microbatches=48), seq_len=2048)
    assert sharded.params == pytest.approx(memory.params / 32)  # "further reduced by d=32"


def test_activation_memory_per_layer_34sbh_5as2b():
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s=s, b=b, h=h, a=a) == 34 * s * b * h + 5 * a * s * s * b
    t = 8
    tp = activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=t)
    assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=t, sp=True)
    assert sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    sel = activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=t, recompute="selective")
    assert sel == pytest.approx(s * b * h * (10 + 24 / t))
    assert activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=t, sp=True,
                                      recompute="selective") == pytest.approx(34 * s * b * h / t)
    assert activation_bytes_per_layer(s=s, b=b, h=h, a=a, recompute="full") == 2 * s * b * h


def test_search_gpt3_on_1024_a100_under_10_s():
    start = time.perf_counter()
    code, out, _ = run_cli(SEARCH + ["--json", "--top", "5"])
    assert time.perf_counter() - start < 10
    assert code == 0
    doc = json.loads(out)
    assert len(doc["ranked"]) == 5
    steps = [p["time"]["step_s"] for p in doc["ranked"]]
    assert steps == sorted(steps)
    for plan in doc["ranked"]:
        lay = plan["layout"]
        assert lay["tp"] <= 8 and 96 % lay["pp"] == 0
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 1024
        assert plan["memory_per_gpu_bytes"]["total"] <= 80e9
        assert plan["memory_per_gpu_bytes"]["fits"]
    assert doc["rejected"] and all("needs" in r["reason"] for r in doc["rejected"])


def _keys(doc: dict) -> None:
    assert doc["model"]["params"] == 174_604_259_328
    assert doc["model"]["params_non_embedding"] == param_counts(GPT3).non_embedding
    assert doc["model"]["flops_per_token"] > 0
    assert doc["step"]["hardware_flops"] >= doc["step"]["model_flops"] > 0
    assert set(doc["memory_per_gpu_bytes"]) >= {"params", "grads", "optimizer", "master",
                                                "activations", "activations_per_layer",
                                                "buffers", "total"}
    assert doc["comm"]["bytes_per_step"]["dp"] and doc["comm"]["time_s"] > 0
    assert set(doc["time"]) >= {"step_s", "compute_s", "exposed_comm_s", "bubble_fraction",
                                "tokens_per_s", "mfu", "hfu"}
    assert 0 < doc["time"]["mfu"] <= doc["time"]["hfu"] < 1
    assert "conventions" in doc


def test_json_document_for_a_layout():
    code, out, _ = run_cli(SEARCH + ["--layout", "tp=8,pp=4,zero=1,sp=true,recompute=selective",
                                     "--tokens", "300B", "--step-time", "30", "--json"])
    assert code == 0
    doc = json.loads(out)
    _keys(doc)
    assert doc["layout"]["dp"] == 32 and doc["training_days"] > 0
    assert doc["measured"]["step_s"] == 30 and 0 < doc["measured"]["mfu"] < 1
    assert set(doc["comm"]["bytes_per_step"]) == {"dp", "tp", "pp"}


def test_json_document_when_searching():
    code, out, _ = run_cli(SEARCH + ["--json", "--top", "2", "--tokens", "300e9"])
    doc = json.loads(out)
    _keys(doc)
    assert "training_days" in doc
    for plan in doc["ranked"]:
        _keys(plan | {"conventions": doc["conventions"]})


def test_human_output_has_tables():
    code, out, _ = run_cli(SEARCH + ["--top", "3"])
    assert code == 0
    assert "ranked layouts" in out and "memory per GPU (GB)" in out and "conventions" in out


@pytest.mark.parametrize("argv,needles", [
    (SEARCH + ["--layout", "dp=16,tp=8,pp=4"], ["= 512 does not equal --gpus 1024"]),
    (SEARCH + ["--layout", "tp=16,pp=4"], ["tp=16 is above the node size 8"]),
    # (on 8 such GPUs ZeRO-Infinity's cpu offload of every state, gradients included, fits)
    (["--model", "llama3-405b", "--gpus", "1", "--gpu", "a100-40gb"],
     ["fits nowhere", "GB more than the", "knob that helps most", "pipeline stages and GPUs"]),
    (SEARCH + ["--layout", "tp=8,pp=4,zero=0"], ["GB more than the", "knob that helps most"]),
    (["--model", "gpt5", "--gpus", "8"], ["'gpt5' does not exist", "gpt3-175b"]),
    (SEARCH + ["--model.dimm", "3"], ["'dimm'", "did you mean 'dim'"]),
    (SEARCH + ["--layout", "tp=8,pipeline=4"], ["unknown key 'pipeline'"]),
    (SEARCH + ["--gpu", "tpu"], ["unknown --gpu 'tpu'"]),
    (SEARCH + ["--hw.flops", "1"], ["unknown hardware field --hw.flops"]),
    (SEARCH + ["--train.steps", "3"], ["unexpected option --train.steps"]),
])
def test_bad_input_exit_code_2(argv, needles):
    code, _, err = run_cli(argv)
    assert code == 2
    for needle in needles:
        assert needle in err


def test_the_planner_does_not_load_torch():
    """plan/ and cost/collectives.py are pure arithmetic: planning must not pay torch's import."""
    import subprocess
    import sys

    code = "import sys, shardtrain.plan.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
