"""Routing as DeepSeek-V3 trains it (model/moe_routing.py): sigmoid scores, the expert
bias of auxiliary-loss-free balancing (state: checkpointed, resumed, agreed by every
replica, never the optimizer's), the sequence-wise balance loss, and per-layer MaxVio."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from shardtrain import config
from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.moe import layer_balance
from shardtrain.model.moe_routing import bias_step, route, row_counts, sequence_balance_loss
from shardtrain.train.observe.report import report
from shardtrain.train.trainer import Trainer

from moe_parity import check_moe_layouts
from parity import make_mesh, tiny, train_layout

BIAS = ("--model.n_experts", "4", "--model.moe_score", "sigmoid", "--model.moe_balance",
        "bias", "--model.moe_aux_loss_coef", "0.001", "--model.moe_bias_rate", "0.01")
STEPS = ("--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2")


def _router(e: int = 4, c: int = 8, seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    router = torch.nn.Linear(c, e, bias=False)
    router.weight.data = torch.randn(e, c, generator=gen)
    return router, torch.randn(12, c, generator=gen)


def test_sigmoid_gates_are_the_chosen_affinities_normalised():
    router, x = _router()
    r = route(x, router, 2, "sigmoid")
    s = (x @ router.weight.t()).sigmoid()
    top, idx = s.topk(2, dim=-1)
    assert torch.equal(r.experts, idx)
    torch.testing.assert_close(r.weights, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(r.probs, s / s.sum(-1, keepdim=True))
    one = route(x, router, 1, "sigmoid")  # top-1: the score itself, not 1
    torch.testing.assert_close(one.weights, s.max(-1, keepdim=True).values)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_bias_steers_the_choice_not_the_gates(score):
    router, x = _router()
    plain = route(x, router, 2, score)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is taken by every token
    r = route(x, router, 2, score, bias)
    assert (r.experts == 3).any(-1).all()
    unbiased = plain.probs if score == "softmax" else (x @ router.weight.t()).sigmoid()
    chosen = unbiased.gather(1, r.experts)
    torch.testing.assert_close(r.weights, chosen / chosen.sum(-1, keepdim=True))
    r.weights.sum().backward()  # the gates' gradient reaches the router; the bias has none
    assert router.weight.grad.abs().sum() > 0


def test_sequence_balance_loss_by_hand_and_bias_step():
    router, x = _router()
    r = route(x, router, 2, "sigmoid")  # 12 tokens: 3 sequences of 4
    counts = row_counts(r.experts, 3, 4)
    assert counts.sum(-1).tolist() == [8, 8, 8]
    want = 0.0
    for b in range(3):
        rows = slice(4 * b, 4 * b + 4)
        f = [4 / (2 * 4) * int((r.experts[rows] == i).sum()) for i in range(4)]
        p = r.probs[rows].mean(0)
        want += sum(f[i] * p[i] for i in range(4)) / 3
    torch.testing.assert_close(sequence_balance_loss(r, counts), torch.as_tensor(want))
    bias = torch.zeros(4)
    bias_step(bias, torch.tensor([10, 2, 6, 6]), 0.5)  # mean 6: busy down, idle up
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    # MaxVio per layer: max load / mean load - 1 (two layers: loads, then dropped slots)
    two = ModelConfig(n_experts=4, n_layers=2)
    assert layer_balance([0.0] * 6 + [10, 2, 6, 6, 3, 6, 6, 6, 6, 0], two) == \
        {"moe_maxvio": [round(10 / 6 - 1, 6), 0.0], "moe_dropped_layers": [3, 0]}
    first_dense = ModelConfig(n_experts=4, n_layers=2, moe_first_dense=1)  # no row of its own
    assert layer_balance([0.0] * 6 + [0] * 5 + [6, 6, 6, 6, 0], first_dense) == \
        {"moe_maxvio": [None, 0.0], "moe_dropped_layers": [None, 0]}


@pytest.mark.parametrize("overrides,field", [
    (dict(n_experts=4, moe_score="cosine"), "model.moe_score"),
    (dict(n_experts=4, moe_balance="loss"), "model.moe_balance"),
    (dict(n_experts=4, moe_balance="none"), "model.moe_aux_loss_coef"),
    (dict(n_experts=4, moe_bias_rate=0.01), "model.moe_bias_rate"),
    (dict(n_experts=4, moe_balance="bias", moe_bias_rate=-1.0), "model.moe_bias_rate"),
])
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig(**overrides).validate()


def _bias_and_balance(trainer: Trainer) -> dict:
    """The final expert biases and the logged per-layer MaxVio (rank 0 writes metrics)."""
    out = {"bias": {k: v for k, v in trainer.parallel.full_state_dict().items()
                    if k.endswith("expert_bias")}}
    path = Path(trainer.cfg.train.run_dir) / "metrics.jsonl"
    if path.exists():
        out["maxvio"] = [json.loads(line)["moe_maxvio"]
                         for line in path.read_text().splitlines()]
    return out


def test_the_bias_moves_is_no_parameter_and_resumes(tmp_path):
    """One process: the bias moves by the rate each step (a sign, so +-rate per step), is
    a buffer of the model and no parameter of the optimizer, the metrics carry MaxVio per
    layer, and a run resumed at step 2 continues bitwise, bias included."""
    cfg = tiny(tmp_path, "whole", *BIAS, *STEPS)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    whole = trainer.run().losses
    got = _bias_and_balance(trainer)
    assert sorted(got["bias"]) == ["layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias"]
    for bias in got["bias"].values():
        steps = bias / 0.01  # a sum of 4 signs
        torch.testing.assert_close(steps, steps.round())
        assert bias.abs().sum() > 0 and steps.abs().max() <= 4
    params = {id(p) for p in trainer.parallel.module.parameters()}
    assert not any(id(b) in params for b in trainer.parallel.module.buffers())
    assert len(got["maxvio"]) == 4 and all(len(v) == 2 and min(v) >= 0 for v in got["maxvio"])
    shown = io.StringIO()  # shardtrain report: the table per layer and the chart
    report(tmp_path / "whole", shown)
    last = shown.getvalue().split("MaxVio first")[1].splitlines()[2].split()
    assert last[0] == "1" and float(last[2]) == pytest.approx(got["maxvio"][-1][1], abs=1e-3)
    assert (tmp_path / "whole" / "moe_balance.png").stat().st_size > 1000
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    cfg = tiny(tmp_path, "resumed", *BIAS, *STEPS, "--checkpoint.resume", str(step2))
    resumed = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    assert resumed.run().losses == whole[2:]
    for name, bias in _bias_and_balance(resumed)["bias"].items():
        assert torch.equal(bias, got["bias"][name]), name


@pytest.mark.slow  # a 2-rank spawn of seven rows and a 4-rank one of two (~90 s loaded)
def test_bias_balancing_parity(tmp_path):
    """ep=2, tp=2, pp=2, cp=2, dp=2 x ZeRO-3 and ep=2 x dp=2 x ZeRO-2 train as one process
    does, fp32: the same losses and weights and bitwise the same expert biases (the load
    summed over every rank that routes other tokens, so every replica moves its bias
    alike) and logged MaxVio; bf16 within the bf16 bounds. The ep=2 run's step-2
    checkpoint resumes on one process (ep=2 -> ep=1) to the same losses and biases."""
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *BIAS, *STEPS, *o))  # noqa
    reference, rows = check_moe_layouts(text, _bias_and_balance, tp=("--parallel.tp", "2"))
    for label, per_rank in rows.items():
        if "bf16" not in label:
            # Integer loads (scaled alike where cp counts a group twice): equal ratios.
            assert per_rank[0]["maxvio"] == reference["maxvio"], label
    step2 = tmp_path / "ep2" / "checkpoints" / "step_00000002"
    resumed = train_layout(0, 1, text("ep2-to-ep1", "--checkpoint.resume", str(step2)),
                           _bias_and_balance)
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(reference["losses"][2:]), rtol=1e-5, atol=0)
    for name, bias in reference["bias"].items():
        assert torch.equal(resumed["bias"][name], bias), ("resumed", name)
