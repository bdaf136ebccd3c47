"""Planner internals: conventions of memory, traffic, time, hardware, calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtrain.config import ConfigError, load
from shardtrain.cost import calibration, hardware
from shardtrain.plan.closed_form import korthikanti_hardware_flops, narayanan_model_flops
from shardtrain.cost.counts import hardware_flops_per_token, model_flops_per_token, param_counts
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.layout import Layout, PlanError, check
from shardtrain.plan.layout_text import parse_layout
from shardtrain.plan.memory import in_flight, memory_per_gpu, model_states
from shardtrain.plan.rank_states import runtime_adamw_fp32
from shardtrain.plan.partition import rank_params
from shardtrain.plan.search import search
from shardtrain.plan.traffic import Placement, bytes_per_step, data_parallel_ops, step_ops

GPT3 = load("gpt3-175b").model
LLAMA = load("llama3-8b").model
A100 = hardware.get("a100")
LINK = A100.intra_link()


def test_itemised_model_states():
    bf16 = model_states(1.0)
    assert (bf16.params, bf16.grads, bf16.master, bf16.optimizer) == (2, 2, 4, 8)
    assert bf16.master + bf16.optimizer == 12  # K
    fp32 = model_states(1.0, precision="fp32")
    assert (fp32.params, fp32.grads, fp32.master, fp32.optimizer) == (4, 4, 0, 8)
    z1 = model_states(100.0, nd=4, zero=1, precision="fp32")
    assert (z1.params, z1.grads, z1.optimizer) == (400, 400, 200)


def test_runtime_convention_exact():
    states = runtime_adamw_fp32(1000, grad_padding=24, step_tensors=5)
    assert (states.params, states.grads, states.master, states.optimizer) == (4000, 4096, 0, 8020)
    assert runtime_adamw_fp32(1000).total == 16000


def test_partition_sums_to_the_model():
    for cfg in (GPT3, LLAMA):
        assert rank_params(cfg, Layout()).total == param_counts(cfg).total
        counts = param_counts(cfg)
        two = rank_params(cfg, Layout(pp=2))
        assert two.layers == cfg.n_layers // 2
        assert two.total * 2 >= counts.total  # the busiest of two stages
    assert rank_params(GPT3, Layout(pp=8, v=3, schedule="interleaved")).layers == 12


def test_in_flight_microbatches():
    assert in_flight("gpipe", 16, 4) == 16
    assert in_flight("1f1b", 16, 4) == 4 and in_flight("1f1b", 2, 4) == 2
    assert in_flight("interleaved", 16, 4, 2) == pytest.approx(4 * (1 + 3 / 8))


def test_activation_memory_scales_with_stage_and_schedule():
    base = dict(dp=1, tp=8, pp=4, micro_batch=1, microbatches=8)
    one_f = memory_per_gpu(GPT3, Layout(**base), seq_len=2048)
    gpipe = memory_per_gpu(GPT3, Layout(**base, schedule="gpipe"), seq_len=2048)
    assert one_f.activations == pytest.approx(one_f.activations_per_layer * 24 * 4)
    assert gpipe.activations == pytest.approx(one_f.activations * 2)
    full = memory_per_gpu(GPT3, Layout(**base, recompute="full"), seq_len=2048)
    assert full.activations == pytest.approx(2 * 2048 * 12288 * 24 * 4
                                              + one_f.activations_per_layer)


def test_offload_moves_states_off_the_gpu():
    lay = dict(dp=8, micro_batch=1, microbatches=1)
    on = memory_per_gpu(LLAMA, Layout(**lay, zero=3), seq_len=1024)
    cpu = memory_per_gpu(LLAMA, Layout(**lay, zero=3, offload="cpu"), seq_len=1024)
    nvme = memory_per_gpu(LLAMA, Layout(**lay, zero=3, offload="nvme"), seq_len=1024)
    # ZeRO-Infinity: under ZeRO-3 both tiers take the parameter shards too (bf16
    # convention: the 16-bit shard beside the fp32 master) and, under ZeRO-2 and 3, the
    # reduced gradient shards; cpu and nvme differ in where.
    assert cpu.master == cpu.optimizer == cpu.params == cpu.grads == 0
    assert cpu.offloaded == on.master + on.optimizer + on.params + on.grads == nvme.offloaded
    assert nvme.params == nvme.grads == 0 and on.grads > 0
    # fp32 parameters are their own master: offloaded they are the 4 bytes of the master,
    # beside the 8 of the moments. ZeRO-2 keeps its full parameters on the device, and the
    # host holds the fp32 master copy the step updates.
    fp32 = dict(lay, precision="amp")
    on32 = memory_per_gpu(LLAMA, Layout(**fp32, zero=3), seq_len=1024)
    off32 = memory_per_gpu(LLAMA, Layout(**fp32, zero=3, offload="nvme"), seq_len=1024)
    assert off32.params == 0 and off32.offloaded == pytest.approx(4 * on32.params)
    z2 = memory_per_gpu(LLAMA, Layout(**fp32, zero=2), seq_len=1024)
    z2_cpu = memory_per_gpu(LLAMA, Layout(**fp32, zero=2, offload="cpu"), seq_len=1024)
    assert z2_cpu.params == z2.params and z2_cpu.optimizer == z2_cpu.grads == 0
    assert z2_cpu.offloaded == pytest.approx(z2.optimizer * 2)  # 4 + 8 + 4 per shard element


def test_dp_and_zero_bytes_per_rank():
    psi, n = 1e9, 8
    where = Placement(link=LINK)

    def sent(zero, m=1):
        ops = data_parallel_ops(group="dp", params=psi, size=n, zero=zero, microbatches=m,
                                precision="bf16", where=where)
        return sum(op.bytes_sent for op in ops)
    dp = sent(0)
    assert dp == pytest.approx(2 * (n - 1) / n * 2 * psi)  # 2(n-1)/n of the gradient bytes
    assert sent(1) == pytest.approx(dp) and sent(2) == pytest.approx(dp)
    assert sent(3) == pytest.approx(1.5 * dp)
    assert sent(0, m=4) == pytest.approx(dp)  # gradients accumulate locally
    assert sent(3, m=4) == pytest.approx(4 * 1.5 * dp)
    assert data_parallel_ops(params=psi, size=1, zero=0) == []
    # bytes only (the runtime's ledger comparison): fp32 DDP, one all-reduce per step
    fp32 = data_parallel_ops(params=psi, size=n, zero=0, microbatches=4, precision="fp32")
    assert [(o.op, o.algorithm) for o in fp32] == [("all_reduce", "ring")]
    assert fp32[0].bytes_sent == pytest.approx(2 * (n - 1) / n * 4 * psi)


def test_tensor_and_pipeline_traffic():
    s, b, h, t = 2048, 1, 12288, 8
    x = s * b * h * 2
    lay = Layout(dp=1, tp=t, pp=4, micro_batch=b, microbatches=8)
    per_step = bytes_per_step(step_ops(GPT3, lay, A100, seq_len=s))
    layers_mb, m = 24 * 8, 8
    # Megatron's four all-reduces per layer, the head's one in backward, and the
    # vocabulary-parallel loss's two (fp32 maxima and sums over s b tokens, latency-bound:
    # priced by their own algorithm) on the last stage; the embedding's sits on the first
    # (plan/tensor_traffic.py)
    ops = [o for o in step_ops(GPT3, lay, A100, seq_len=s) if o.group == "tp"]
    assert sorted(o.message_bytes for o in ops) == [4 * s * b, 8 * s * b, x]
    loss = sum(o.bytes_sent for o in ops if o.message_bytes < x)
    assert per_step["tp"]["all_reduce"] == pytest.approx(
        (4 * layers_mb + m) * 2 * (t - 1) / t * x + loss)
    sp = bytes_per_step(step_ops(GPT3, Layout(dp=1, tp=t, pp=4, sp=True, micro_batch=b,
                                              microbatches=8), A100, seq_len=s))
    # sp: the same bytes, plus the backward's re-gather of each region's input (two per
    # layer, and the head's)
    assert sum(sp["tp"].values()) == pytest.approx(
        per_step["tp"]["all_reduce"] + (t - 1) / t * x * (2 * layers_mb + m))
    assert per_step["pp"]["send_recv"] == pytest.approx(2 * 8 * x)


def test_exact_flops_match_the_closed_forms():
    s, batch = 2048, 4
    tokens = s * batch
    assert model_flops_per_token(GPT3, s) * tokens == pytest.approx(
        narayanan_model_flops(GPT3, batch=batch, seq_len=s))
    # full: the runtime's checkpoint stops before each block's last matmul (w2, 8 h^2 per
    # token and layer forward for f = 4h): the paper's 96 form less 8 B s L h^2
    h, L = GPT3.dim, GPT3.n_layers
    assert hardware_flops_per_token(GPT3, s, "full") * tokens == pytest.approx(
        korthikanti_hardware_flops(GPT3, batch=batch, seq_len=s, recompute="full")
        - 8 * batch * s * L * h * h)
    # selective: the paper charges 12 s^2 h per layer and sequence for the recomputed
    # attention core; the runtime reruns its forward only, 4 s^2 h
    assert hardware_flops_per_token(GPT3, s, "selective") * tokens == pytest.approx(
        korthikanti_hardware_flops(GPT3, batch=batch, seq_len=s, recompute="selective")
        - 8 * batch * s * s * L * h)
    assert (hardware_flops_per_token(GPT3, s, "selective")
            - model_flops_per_token(GPT3, s)) * tokens == pytest.approx(4 * batch * s * s * L * h)


def test_step_time_mfu_and_days():
    plan = evaluate(GPT3, Layout(dp=32, tp=8, pp=4, micro_batch=1, microbatches=48), A100,
                    global_batch=1536, seq_len=2048)
    t = plan.time
    assert t.step_s > t.compute_s > 0
    assert t.tokens_per_s == pytest.approx(1536 * 2048 / t.step_s)
    assert t.mfu == pytest.approx(plan.model_flops / (t.step_s * 1024 * 312e12))
    assert plan.to_dict(tokens=300e9)["training_days"] == pytest.approx(
        300e9 / t.tokens_per_s / 86400)
    measured = plan.to_dict(measured_step_s=2 * t.step_s)["measured"]
    assert measured["mfu"] == pytest.approx(t.mfu / 2)


def test_layout_parsing_fills_dp_and_microbatches():
    lay = parse_layout("tp=8,pp=4,microbatches=16,sp=true,zero=1", gpus=1024,
                       global_batch=1536, precision="bf16")
    assert (lay.dp, lay.micro_batch, lay.microbatches, lay.sp) == (32, 3, 16, True)
    with pytest.raises(PlanError, match="needs schedule=interleaved"):
        check(Layout(dp=8, v=2), GPT3, gpus=8, node_size=8, global_batch=8, seq_len=2048)
    with pytest.raises(PlanError, match="offload=nvme needs"):
        check(Layout(dp=8, offload="nvme", zero=1), GPT3, gpus=8, node_size=8, global_batch=8,
              seq_len=2048)
    with pytest.raises(PlanError, match="does not equal the global batch"):
        check(Layout(dp=8), GPT3, gpus=8, node_size=8, global_batch=16, seq_len=2048)


def test_hardware_presets_and_overrides():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200"):
        hw = hardware.get(name)
        assert hw.peak_flops > 1e14 and hw.memory_bytes > 30e9 and hw.gpus_per_node == 8
    assert hardware.get("h100").name == "h100-sxm"
    hw = hardware.get("a100", {"efficiency": "0.5", "gpus_per_node": "4"})
    assert hw.efficiency == 0.5 and hw.gpus_per_node == 4
    with pytest.raises(ConfigError, match="did you mean 'efficiency'"):
        hardware.get("a100", {"eficiency": "1"})


def test_calibration_roundtrip_and_cpu_preset(tmp_path: Path):
    path = tmp_path / "cal.json"
    assert calibration.load(path) is None
    assert hardware.get("cpu", calibration_path=path).peak_flops == calibration.DEFAULT.flops_per_s
    cal = calibration.Calibration(flops_per_s=3e10, alpha_s=1e-4, beta_s_per_byte=1e-9,
                                  gamma_s_per_byte=2e-10, cores=2, measured_at="2026-01-01T00:00")
    assert calibration.save(cal, path) == path and calibration.load(path) == cal
    assert set(json.loads(path.read_text())) == {"flops_per_s", "alpha_s", "beta_s_per_byte",
                                                 "gamma_s_per_byte", "cores", "measured_at",
                                                 "efficiency", "shared_s_per_byte",
                                                 "native_alpha_s", "staging_s_per_byte"}
    cpu = hardware.get("cpu", calibration_path=path)
    assert cpu.peak_flops == 3e10 and cpu.intra_link().alpha_s == 1e-4
    assert cpu.intra_link().native_alpha_s == 1e-4  # not measured: the backend's is ours
    data = json.loads(path.read_text())
    for key in ("native_alpha_s", "staging_s_per_byte"):  # files from before these keys
        del data[key]
    path.write_text(json.dumps(data))
    assert calibration.load(path).link() == cal.link()
    path.write_text(json.dumps({**data, "native_alpha_s": 2e-5, "staging_s_per_byte": 1e-9}))
    native = hardware.get("cpu", calibration_path=path).inter_link()
    assert native.native_alpha_s == 2e-5 and native.staging_s_per_byte == pytest.approx(1e-9)
    assert native.backend == "gloo" and hardware.get("h100").inter_link().backend == "nccl"
    with pytest.raises(ConfigError, match="--hw.backend='mpi'"):
        hardware.get("h100", {"backend": "mpi"})
    del data["efficiency"]  # optional: a file without it loads with efficiency 1.0
    path.write_text(json.dumps(data))
    assert hardware.get("cpu", calibration_path=path).efficiency == 1.0
    path.write_text(json.dumps({**data, "efficiency": 0.75}))
    assert hardware.get("cpu", calibration_path=path).efficiency == 0.75
    assert cpu.intra_link().beta_s_per_byte == pytest.approx(1e-9)
    assert cpu.default_precision == "fp32" and cpu.node_size(4) == 4
    # a host whose processes share one medium: the fit may put every byte on it (beta 0)
    path.write_text(json.dumps({**data, "beta_s_per_byte": 0.0, "shared_s_per_byte": 3e-10}))
    shared = hardware.get("cpu", calibration_path=path)
    assert shared.intra_link().shared_s_per_byte == pytest.approx(3e-10)
    assert shared.to_dict()["intra_bw"] is None  # unlimited per rank: JSON null
    path.write_text('{"flops_per_s": 1}')
    with pytest.raises(ConfigError, match="lacks alpha_s"):
        calibration.load(path)


def test_cpu_step_time_for_tiny():
    tiny = load("tiny").model
    hw = hardware.get("cpu", calibration_path="/nonexistent/cal.json")
    plan = evaluate(tiny, Layout(dp=2, micro_batch=2, microbatches=2, precision="fp32"), hw,
                    global_batch=8, seq_len=32)
    compute = plan.hardware_flops / (2 * calibration.DEFAULT.flops_per_s)
    # tiny's matmuls stay above this CPU's ridge (flops_per_s / memory bandwidth = 5
    # FLOP/byte): the FLOPs term is theirs; norms, adds and the optimizer add their bytes
    assert compute == pytest.approx(plan.time.compute_bound_s)
    assert plan.time.step_s >= plan.time.compute_s > compute and plan.time.memory_bound_s > 0
    assert plan.fits and plan.memory.master == 0


def test_moe_layouts_shard_experts():
    moe = load("tiny", ["--model.n_experts", "8", "--model.moe_top_k", "2"]).model
    counts = param_counts(moe)
    assert counts.active < counts.total
    split = rank_params(moe, Layout(dp=4, ep=4))
    assert split.expert == pytest.approx(moe.n_layers * 8 * 3 * moe.dim * moe.ffn_hidden / 4)
    ops = step_ops(moe, Layout(dp=4, ep=4, micro_batch=1, microbatches=2, precision="fp32"),
                   hardware.get("a100"), seq_len=32)
    assert {op.group for op in ops} == {"dp", "ep"}  # edp has one rank per group here
    result = search(moe, hardware.get("a100"), gpus=4, global_batch=8, seq_len=32, top=3)
    assert result.ranked and all(p.fits for p in result.ranked)


def test_runtime_link_prices_a_gpu_group_with_its_preset_never_the_cpu_calibration(tmp_path):
    """What comm's `auto` prices with (cost.hardware.runtime_link, chosen by the mesh)."""
    path = tmp_path / "cal.json"
    calibration.save(calibration.Calibration(flops_per_s=1e10, alpha_s=7e-5, beta_s_per_byte=3e-9,
                                             gamma_s_per_byte=1e-9, cores=2, measured_at="t"),
                     path)
    assert hardware.runtime_link("cpu", calibration_path=path) == calibration.load(path).link()
    h100 = hardware.PRESETS["h100-sxm"]
    name = "NVIDIA H100 80GB HBM3"
    assert hardware.gpu_preset(name) is h100
    assert hardware.gpu_preset("NVIDIA H100 PCIe").name == "h100-pcie"
    assert hardware.runtime_link("cuda", gpu_name=name, calibration_path=path) == h100.intra_link()
    assert hardware.runtime_link("cuda", gpu_name=name, across_nodes=True) == h100.inter_link()
    unknown = hardware.runtime_link("cuda", gpu_name="Some Future GPU", calibration_path=path)
    assert unknown == hardware.GENERIC_PCIE.intra_link() and unknown.backend == "nccl"
