"""The planner proposes only what the trainer runs: every layout `search` ranks (dense and
mixture-of-experts models; and what `shardtrain plan --json` prints), and for a small model
every candidate it enumerates, turned into config overrides
(plan.layout.layout_overrides) passes the training config's validation."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.cli import main
from shardtrain.cost.counts import param_counts
from shardtrain.plan.layout import Layout, PlanError, check, layout_overrides
from shardtrain.plan.partition import rank_params
from shardtrain.plan.search import candidates, search

MOE = ("--model.n_experts", "8", "--model.moe_top_k", "2")  # a Mixtral-like split of the MLP
CASES = [  # preset, hardware, gpus, global batch, sequence, model overrides
    ("llama3-8b", "h100", 64, 256, 8192, ()),  # cp (ring and Ulysses) candidates, GQA, tp
    ("llama3-70b", "h100", 256, 512, 8192, ()),
    ("gpt3-175b", "a100", 1024, 1536, 2048, ()),
    ("llama3-8b", "h100", 32, 256, 8192, MOE),  # ep candidates with dp, cp, tp, pp, zero
    ("llama3-8b", "a100", 256, 1024, 4096, MOE),
    ("tiny", "a100", 8, 8, 64, MOE),
]


def _validate(preset: str, layout: Layout, seq_len: int, *extra: str) -> None:
    cfg = config.load(preset, [*extra, *layout_overrides(layout, seq_len=seq_len)])
    cfg.validate(layout.gpus)
    p = cfg.parallel  # the overrides say what the layout says
    assert (p.dp, p.tp, p.pp, p.cp, p.cp_mode, p.ep, p.zero, p.sp) == (
        layout.dp, layout.tp, layout.pp, layout.cp, layout.cp_mode, layout.ep, layout.zero,
        layout.sp)
    assert cfg.train.activation_checkpointing == layout.recompute
    assert (p.schedule, p.virtual_stages) == (layout.schedule, layout.v)
    assert (p.zero_quantized_weights, p.zero_hpz, p.zero_quantized_gradients) == (
        layout.qwz, layout.hpz, layout.qgz)  # ZeRO++: the search proposes it (search.py)
    assert p.zero_accumulate == layout.accumulate  # so it does unsharded accumulation


@pytest.mark.parametrize("preset, hw, gpus, batch, seq, extra", CASES,
                         ids=[c[0] + ("-moe" if c[5] else "") for c in CASES])
def test_ranked_layouts_pass_config_validation(preset, hw, gpus, batch, seq, extra):
    model = config.load(preset, list(extra)).model
    result = search(model, hardware.get(hw), gpus=gpus, global_batch=batch, seq_len=seq,
                    top=20, zeropp=True)
    assert result.ranked
    for plan in result.ranked:
        _validate(preset, plan.layout, seq, *extra)
    if (preset, extra) == ("llama3-8b", ()):  # its dp groups span nodes: ZeRO++ ranks
        assert any(p.layout.qwz or p.layout.qgz for p in result.ranked)
        assert any(p.layout.accumulate == "unsharded" for p in result.ranked)
    if preset == "gpt3-175b":  # 48 micro-batches over 16 stages: the V's bubble pays
        assert any(p.layout.schedule in ("zbv", "dualpipev") for p in result.ranked)
    print(f"{preset}{' moe' if extra else ''} on {gpus}: {result.considered} candidates run, "
          f"{result.refused} refused by config validation; best {result.ranked[0].layout.describe()}")


@pytest.mark.parametrize("argv, extra", [
    (["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100"], ()),
    (["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100"], MOE),
    (["--model", "tiny", "--gpus", "4", "--gpu", "a100", "--global-batch", "8"], MOE),
])
def test_cli_ranked_layouts_pass_config_validation(argv, extra):
    """What `shardtrain plan --json` ranks, read back from the document."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, *extra, "--top", "10", "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert doc["fits"] and doc["ranked"]
    for plan in doc["ranked"]:
        layout = Layout(**{k: v for k, v in plan["layout"].items() if k != "text"})
        assert layout.gpus == int(argv[3])
        assert not (layout.qwz or layout.hpz or layout.qgz)  # lossy: only with --zeropp
        _validate(argv[1], layout, plan["seq"], *extra)


def test_every_candidate_of_a_small_model_passes_config_validation():
    """tiny's shapes (4 heads, 2 kv heads) on 8 ranks with a long sequence: tp, pp, cp
    (both modes), ZeRO, sp, schedules and offload all enumerated, none refused."""
    longer = ("--model.max_seq_len", "8192")
    model = config.load("tiny", list(longer)).model
    seen = 0
    for offload in ("none", "cpu", "nvme"):
        for layout in candidates(model, gpus=8, node_size=8, global_batch=8, seq_len=8192,
                                 precision="bf16", offload=offload):
            # gpipe and the recompute modes validate as 1f1b and none do (config.load is slow)
            if layout.schedule != "gpipe" and (layout.recompute == "none" or seen % 50 == 0):
                _validate("tiny", layout, 8192, *longer)
                seen += 1
    assert seen > 150


def test_v_schedules_as_given_layouts():
    """ZB-V and DualPipeV (not enumerated: search.py says why) evaluate as a given layout
    that the trainer's validation accepts, with the V's stage 0 holding the embedding and
    the head (as one process does); a V the trainer refuses is refused here too."""
    model = config.load("llama3-8b", []).model
    counts = param_counts(model)
    outside = counts.total - model.n_layers * counts.per_layer  # embedding, head, norm
    for schedule in ("zbv", "dualpipev"):
        lay = Layout(dp=1, pp=2, microbatches=4, micro_batch=1, schedule=schedule, v=2,
                     precision="bf16")
        _validate("llama3-8b", lay, 4096)
        held = rank_params(model, lay)
        assert held.dense == held.layers * counts.per_layer + outside
        assert held.dense > rank_params(model, replace(lay, schedule="zb-h1", v=1)).dense
    with pytest.raises(PlanError, match="microbatches >= 4"):
        check(replace(lay, microbatches=2), model, gpus=2, node_size=8, global_batch=2,
              seq_len=4096)
