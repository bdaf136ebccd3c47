"""`shardtrain train --dry-run-world N`: rank 0 of an N-rank layout in one process over a
fake process group (train/start/dryrun.py). Its model-state bytes equal the planner's exact
per-rank count (plan/rank_states.py: the runtime's padding restated torch-free) byte for
byte, for the tiny model at dp=64 ZeRO-3 and at tp=2 x pp=2 x dp=16; what it cannot do
it refuses; its report is written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parity import tiny, tiny_data
from shardtrain import config
from shardtrain.cli import main
from shardtrain.comm import CommFactory
from shardtrain.config import ConfigError
from shardtrain.cost.hardware import runtime_link
from shardtrain.mesh import MeshShape, ParallelMesh
from shardtrain.cost.counts import param_counts
from shardtrain.plan.layout import Layout, PlanError, config_layout
from shardtrain.plan.memory import model_states
from shardtrain.plan.rank_states import bucket_padded, rank0_states, rank0_tensors
from shardtrain.train.start import dryrun

STATES = ("params", "grads", "master", "optimizer")
LINK = runtime_link("cpu", gpu_name="", across_nodes=False)
ZERO3_DP64 = ("--parallel.zero", "3", "--train.global_batch", "128")
TP2_PP2_DP16 = ("--parallel.tp", "2", "--parallel.pp", "2", "--train.global_batch", "64",
                "--parallel.microbatches", "2")


def _cli(tmp: Path, name: str, world: int, *overrides: str) -> int:
    return main(["train", "--dry-run-world", str(world), "--config", "tiny",
                 "--train.run_dir", str(tmp / name), *tiny_data(tmp),
                 *overrides])


def _report(tmp: Path, name: str) -> dict:
    return json.loads((tmp / name / "dry_run.json").read_text())


# (name, world, overrides, ZeRO padding elements on rank 0): dp=64 pads nothing for the tiny
# model; dp=48 and dp=24 do, and the planner's count must reproduce it.
LAYOUTS = [
    ("zero3-dp64", 64, ZERO3_DP64, 0),
    ("tp2-pp2-dp16", 64, TP2_PP2_DP16, None),
    ("tp2-pp2-dp16-zero1", 64, (*TP2_PP2_DP16, "--parallel.zero", "1"), 0),
    ("tp4-dp16-zero1", 64, ("--parallel.tp", "4", "--parallel.zero", "1",  # kv heads shared
                            "--train.global_batch", "32"), 0),
    ("gpt2-zero3-dp48", 48, ("--model.style", "gpt2", "--model.n_kv_heads", "0",
                             "--parallel.zero", "3", "--train.global_batch", "96"), 80),
    ("tp2-pp2-dp24-zero1", 96, ("--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero",
                                "1", "--train.global_batch", "96", "--parallel.microbatches",
                                "2"), 32),
    # 16-bit parameters and gradients, no master (train.precision bf16-true, fp16-true; Kahan's
    # bf16 compensation sharded as the moments are): 2 + 2 + 0 + 8 (+ 2) bytes, to the byte
    ("zero3-dp64-bf16-true", 64, (*ZERO3_DP64, "--train.precision", "bf16-true"), None),
    ("tp2-pp2-dp16-fp16-true", 64, (*TP2_PP2_DP16, "--train.precision", "fp16-true"), None),
    ("zero1-dp64-kahan", 64, ("--parallel.zero", "1", "--train.global_batch", "128",
                              "--train.precision", "bf16-true", "--optim.bf16_update",
                              "kahan"), None),
    ("gpt2-dp48-kahan", 48, ("--model.style", "gpt2", "--model.n_kv_heads", "0",
                             "--train.global_batch", "96", "--train.precision", "bf16-true",
                             "--optim.bf16_update", "kahan"), None),
]


@pytest.mark.parametrize("name, world, overrides, padding", LAYOUTS)
def test_rank0_model_states_equal_the_planner_exactly(tmp_path, capsys, name, world,
                                                      overrides, padding):
    assert _cli(tmp_path, name, world, *overrides) == 0
    out = capsys.readouterr().out
    r = _report(tmp_path, name)
    print(out)
    measured, exact = r["measured"], r["planned_exact"]
    assert exact is not None and r["match"] is True and r["skipped_steps"] == 0
    for key in (*STATES, "model_states"):
        assert measured[key] == exact[key] > 0 or key == "master", key
    assert "measured == planned exact" in out and "losses are not real" in out
    # The peak is printed next to the planner's; the step held saved activations.
    assert measured["peak_mem"] > 0 and measured["saved_activations"] > 0
    # the last step's peak: the states held and more (None without glibc's mallinfo2)
    assert measured["step_peak"] is None or measured["step_peak"] > measured["model_states"]
    assert f"{measured['peak_mem']:,}" in out and f"{r['planned_estimate']['total']:,.0f}" in out
    assert r["stage_layers"]["runtime"] == r["stage_layers"]["planner"]
    assert not dist.is_initialized()  # the fake group is gone: the process can go on
    # The padding is what Psi / N_d misses: the ZeRO formulas on the padded count.
    cfg = tiny(tmp_path, name, *overrides)
    cfg.validate(world)
    lay = config_layout(cfg, world)
    assert (lay.dp * lay.tp * lay.pp, lay.zero) == (world, cfg.parallel.zero)
    if padding is not None:
        psi = sum(n for _, n in rank0_tensors(cfg.model, lay))
        padded = model_states(psi + padding, nd=lay.dp, zero=lay.zero, precision="fp32")
        assert {k: exact[k] for k in STATES} == {k: getattr(padded, k) for k in STATES}
        if padding:
            naive = model_states(psi, nd=lay.dp, zero=lay.zero, precision="fp32")
            assert naive.total < sum(exact[k] for k in STATES)


@pytest.mark.parametrize("style, tied", [("llama", False), ("gpt2", True), ("gpt2", False)])
def test_rank0_tensors_of_one_rank_are_the_whole_model(tmp_path, style, tied):
    cfg = tiny(tmp_path, "whole", "--model.style", style,
               "--model.tie_embeddings", str(tied).lower()).model
    assert sum(n for _, n in rank0_tensors(cfg, Layout())) == param_counts(cfg).total


def test_buckets_pad_each_bucket():
    tensors = [("a", 3), ("b", 2**18), ("c", 5)]  # reversed: c, b (1 MiB closes), a
    assert bucket_padded(tensors, nd=4, bucket_mb=25) == (5 + 2**18 + 3) + 3 + 1
    assert bucket_padded(tensors, nd=1, bucket_mb=25) == 5 + 2**18 + 3


def test_llama3_8b_rank0_at_dp64_zero3():
    """What a Llama-3-8B dry run at dp=64 ZeRO-3 would be compared with (fp32 states, 16
    bytes per parameter, sharded 64 ways: ~2.0 GB on rank 0). Not run here: building rank
    0 materialises the whole fp32 model first (~32 GB) before it is sharded."""
    cfg = config.load("llama3-8b", []).model
    lay = Layout(dp=64, zero=3, precision="fp32")
    states = rank0_states(cfg, lay)
    psi = param_counts(cfg).total
    assert 8.0e9 < psi < 8.1e9
    assert states.total == pytest.approx(16 * psi / 64, rel=1e-6)
    assert states.params % 4 == 0 and states.master == 0


@pytest.mark.parametrize("tp", [8, 16])
def test_llama3_8b_tensor_parallel_slices_on_the_meta_device(tmp_path, tp):
    """At Llama-3-8B's shapes (8 kv heads: tp=16 shares each between two ranks), rank 0's
    tensor-parallel tensors, built on the meta device by the runtime, are the planner's."""
    from shardtrain.parallel.tensor.layers import apply_tensor_parallel
    from shardtrain.train.finetune.finetune import build_skeleton

    cfg = config.load("llama3-8b", ["--parallel.tp", str(tp), "--train.run_dir",
                                    str(tmp_path)])
    dryrun.fake_world(tp)
    try:
        mesh = ParallelMesh(MeshShape(tp=tp), rank=0, link=LINK,
                            communicator=CommFactory(kind=dryrun.ZeroFilledCommunicator))
        model = build_skeleton(cfg)
        apply_tensor_parallel(model, mesh.comm("tp"), sp=False)
        built = [(n, p.numel()) for n, p in model.named_parameters()]
    finally:
        dist.destroy_process_group()
    assert built == rank0_tensors(cfg.model, Layout(tp=tp, precision="fp32"))


def test_refusals(tmp_path, capsys):
    cfg = tiny(tmp_path, "ps", "--parallel.ps_servers", "1", "--train.global_batch", "126",
               "--train.micro_batch", "2")
    with pytest.raises(ConfigError, match="ps_servers"):
        dryrun.check_dry_run(cfg, 64)
    with pytest.raises(ConfigError, match="must be >= 2"):
        dryrun.check_dry_run(tiny(tmp_path, "one"), 1)
    assert _cli(tmp_path, "nproc", 64, *ZERO3_DP64, "--nproc", "2") == 2
    assert "drop --nproc" in capsys.readouterr().err
    assert _cli(tmp_path, "bad", 64) == 2  # global batch 8 cannot feed dp=64
    assert "global_batch" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "dry_run.json").exists()
    with pytest.raises(PlanError, match="n_experts"):
        rank0_states(tiny(tmp_path, "moe", "--model.n_experts", "4").model,
                     Layout(precision="fp32"))
    with pytest.raises(ConfigError, match="--comm.algorithm native"):
        dryrun.check_dry_run(tiny(tmp_path, "ring", *ZERO3_DP64, "--comm.algorithm", "ring"), 64)


def test_report_is_written_atomically(tmp_path, monkeypatch, capsys):
    cfg = tiny(tmp_path, "atomic", *ZERO3_DP64, "--train.steps", "1")
    first = dryrun.dry_run(cfg, 64, torch.device("cpu"))
    path = Path(cfg.train.run_dir) / "dry_run.json"
    assert json.loads(path.read_text()) == first
    assert [p.name for p in path.parent.glob(".dry_run.json*")] == []  # no temp file left

    def torn(self, text, *a, **k):  # the write dies halfway
        Path.write_bytes(self, text[: len(text) // 2].encode())
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError):
        dryrun.dry_run(cfg, 64, torch.device("cpu"))
    assert json.loads(path.read_text()) == first  # the old report, whole
    assert not dist.is_initialized()


def test_mesh_on_cuda_under_the_fake_backend_needs_no_gloo_side_group():
    """On CUDA the mesh puts metadata on a Gloo group beside each NCCL group; under the fake
    backend that group cannot exist (Gloo cannot rendezvous over a fake store) and is not
    needed: the fake group carries the metadata. No GPU is touched building it."""
    dryrun.fake_world(8)
    try:
        mesh = ParallelMesh(MeshShape(dp=2, tp=4), rank=0, device=torch.device("cuda"),
                            link=LINK,
                            communicator=CommFactory(kind=dryrun.ZeroFilledCommunicator))
        for dim in ("tp", "dp"):
            comm = mesh.comm(dim)
            assert comm.meta is comm.group and comm.device.type == "cuda"
            assert isinstance(comm, dryrun.ZeroFilledCommunicator)
    finally:
        dist.destroy_process_group()
