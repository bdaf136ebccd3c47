"""Multi-token prediction in the planner (cost/counts.py, plan/): its parameters exactly as
built (the whole model, rank 0's tensors, the last pipeline stage), its matmul FLOPs as the
built model's linears, and no proposed layout that the trainer refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from shardtrain.cli import main
from shardtrain.config import ModelConfig
from shardtrain.cost.counts import matmul_params_per_token, mtp_params, param_counts
from shardtrain.model.mtp import MTPLoss, depth_batch
from shardtrain.model.transformer import build_model
from shardtrain.parallel.activation import SavedActivations
from shardtrain.parallel.pipeline.stage import split_stages
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.plan.activations import mtp_activation_bytes
from shardtrain.plan.layout import Layout, planned_attention
from shardtrain.plan.partition import rank_params
from shardtrain.plan.rank_states import rank0_tensors
from shardtrain.plan.search import candidates

from parity import tiny, tiny_data

MTP = ("--model.mtp_depth", "2")
SHAPES = {
    "llama": (),
    "gpt2-tied": ("--model.style", "gpt2", "--model.n_kv_heads", "0",
                  "--model.tie_embeddings", "true"),
    "moe": ("--model.n_experts", "4", "--model.moe_ffn_dim", "32",
            "--model.moe_shared_experts", "1", "--model.moe_first_dense", "1"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_parameter_counts_are_the_built_models(tmp_path, shape):
    cfg = tiny(tmp_path, "m", *MTP, *SHAPES[shape]).model
    model = build_model(cfg, seed=None)  # shapes only
    built = sum(p.numel() for p in model.parameters())
    assert param_counts(cfg).total == built
    assert mtp_params(cfg) == sum(p.numel() for p in model.mtp.parameters()) > 0
    without = dataclasses.replace(cfg, mtp_depth=0)
    assert param_counts(cfg).total - param_counts(without).total == mtp_params(cfg)
    if not cfg.n_experts:  # rank 0's tensors, in module order (ZeRO's exact padding)
        assert rank0_tensors(cfg, Layout(dp=1)) == [(n, p.numel()) for n, p
                                                    in model.named_parameters()]


def test_matmul_flops_count_each_depths_block_projection_and_head(tmp_path):
    """Per token: every linear's weight once (the MTP projections and blocks included),
    the shared head once more per depth (its logits are computed D + 1 times)."""
    cfg = tiny(tmp_path, "m", *MTP).model
    model = build_model(cfg, seed=None)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params_per_token(cfg) == linears + cfg.mtp_depth * cfg.vocab_size * cfg.dim


@pytest.mark.parametrize("tied", ["false", "true"])
def test_last_stage_holds_the_modules_and_the_table_copy(tmp_path, tied):
    """pp=2 on two blocks: the planner's busiest rank is the last stage, exactly its
    parameters (a block, the final norm, the head, the modules and the table copy)."""
    cfg = tiny(tmp_path, "m", *MTP, "--model.tie_embeddings", tied, "--parallel.pp", "2")
    last, _ = split_stages(build_model(cfg.model, seed=None), cfg, stage=1)
    held = {id(p): p.numel() for p in last.parameters()}  # a tied table once
    assert "tok_emb.weight" in dict(last.named_parameters())
    planned = rank_params(cfg.model, Layout(dp=1, pp=2, microbatches=4))
    assert planned.total == sum(held.values())


def test_planner_proposes_no_layout_the_trainer_refuses(tmp_path):
    cfg: ModelConfig = tiny(tmp_path, "m", *MTP, "--model.n_layers", "4",
                            "--model.max_seq_len", "8192").model
    layouts = list(candidates(cfg, gpus=8, node_size=8, global_batch=16, seq_len=8192,
                              precision="bf16"))
    assert layouts
    assert any(lay.cp > 1 for lay in layouts) and any(lay.zero == 3 for lay in layouts)
    # 2 x dim = 84 features of the projection: tp = 8 refused (config/mtp.py), not without
    odd = dataclasses.replace(cfg, dim=42, n_heads=8, n_kv_heads=8, head_size=8, ffn_dim=64)
    for depth, eight in ((2, False), (0, True)):
        found = candidates(dataclasses.replace(odd, mtp_depth=depth), gpus=8, node_size=8,
                           global_batch=16, seq_len=8192, precision="bf16")
        assert any(lay.tp == 8 for lay in found) == eight, depth


@pytest.mark.parametrize("world, overrides", [
    (48, ("--parallel.zero", "1", "--train.global_batch", "96")),  # ZeRO's padding
    (64, ("--parallel.tp", "2", "--parallel.sp", "true", "--parallel.zero", "2",
          "--model.style", "gpt2", "--model.n_kv_heads", "0", "--train.global_batch", "64")),
    (64, ("--parallel.tp", "2", "--parallel.pp", "2", "--model.n_layers", "4",  # stage 0's
          "--parallel.microbatches", "2", "--train.global_batch", "64")),  # cut: the plain one
])
def test_dry_run_model_states_equal_the_planner(tmp_path, capsys, world, overrides):
    """Rank 0 of a big job over the fake process group (train/start/dryrun.py): its model
    states, the modules' tp slices and ZeRO's padding included, are the planner's exactly."""
    assert main(["train", "--dry-run-world", str(world), "--config", "tiny", *MTP,
                 "--train.run_dir", str(tmp_path / "dry"), *tiny_data(tmp_path),
                 *overrides]) == 0
    report = json.loads((tmp_path / "dry" / "dry_run.json").read_text())
    assert report["planned_exact"] is not None and report["match"] is True
    assert report["stage_layers"]["runtime"] == report["stage_layers"]["planner"]
    assert "measured == planned exact" in capsys.readouterr().out


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_activation_term_is_the_runtimes_measurement(tmp_path, style, precision):
    """What two depths add to what the model keeps for backward (`SavedActivations` around
    the forward and the loss), as the planner counts it, on one rank."""
    b, s = 2, 32
    shape = SHAPES["gpt2-tied"][:4] if style == "gpt2" else ()
    cfg = tiny(tmp_path, "m", *MTP, *shape).model
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 256, (b, s), generator=gen) for _ in range(2))
    kept = {}
    for depth in (0, 2):
        model = build_model(dataclasses.replace(cfg, mtp_depth=depth)).train()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp")
        with SavedActivations(exclude=model) as meter, autocast:
            if depth:  # as the pipeline feeds them (parallel/pipeline/runtime.py)
                inputs, stacked = depth_batch(tokens, targets, None, depth)
                MTPLoss(cross_entropy, model.cfg)(model(tokens, mtp_tokens=inputs), stacked)
            else:
                cross_entropy(model(tokens), targets)
        kept[depth] = meter.bytes
    attention = planned_attention(cfg, "bf16" if precision == "amp" else precision, "cpu")
    lay = Layout(dp=1, micro_batch=b, microbatches=1, precision=precision, attention=attention)
    # each depth's loss also keeps a 0-d loss and a 0-d flag (vocab.py's `where`, 5 bytes)
    # and its fp32 weight T_k / T (mtp.py MTPLoss): what the planner leaves out of the
    # main loss too
    assert kept[2] - kept[0] - 2 * (5 + 4) == mtp_activation_bytes(cfg, lay, seq_len=s) > 0
