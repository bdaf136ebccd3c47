"""The mixture-of-experts block (model/moe.py): dispatch/combine, the auxiliary losses and
their gradient's scale, capacity policies, grouped vs looped experts, config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardtrain import config
from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.moe import (Routing, balance_loss, capacity, combine, dispatch,
                                  expert_counts, loss_grad_scale, route, z_loss)
from shardtrain.model.transformer import build_model, init_expert
from shardtrain.train.trainer import Trainer

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout, train_layouts


def routing_from_logits(logits: torch.Tensor, top_k: int) -> Routing:
    probs = logits.softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return Routing(logits, probs, weights / weights.sum(-1, keepdim=True), experts)


def uniform_weights(r: Routing) -> Routing:
    """The same choices, every chosen expert weighted 1 / top_k."""
    k = r.experts.shape[-1]
    return Routing(r.logits, r.probs, torch.full(r.weights.shape, 1.0 / k), r.experts)


@pytest.mark.parametrize("cap,policy", [(None, "probs"), (2, "probs"), (2, "position")])
def test_dispatch_combine_identity_experts(cap, policy):
    torch.manual_seed(0)
    t, e, k, c = 12, 4, 2, 8
    x = torch.randn(t, c, requires_grad=True)
    r = uniform_weights(routing_from_logits(torch.randn(t, e), k))
    xs, d = dispatch(x, r, cap, policy)
    out = combine(xs, d, t)  # identity experts
    # Which (token, choice) slots each expert keeps, by explicit loops.
    kept = torch.zeros(t)
    for expert in range(e):
        slots = [(tok, j) for tok in range(t) for j in range(k) if r.experts[tok, j] == expert]
        if policy == "probs":
            slots.sort(key=lambda s: -r.probs[s[0], expert].item())
        for tok, _ in slots[:cap]:
            kept[tok] += 1
    assert d.keep.sum() == kept.sum()
    if cap is None:
        assert kept.eq(k).all()
    else:
        assert kept.lt(k).any()  # the example drops something
    expected = x.detach() * (kept / k)[:, None]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    g = torch.randn(t, c)
    out.backward(g)
    torch.testing.assert_close(x.grad, g * (kept / k)[:, None], rtol=0, atol=0)


def test_aux_and_z_loss_by_hand():
    torch.manual_seed(1)
    t, e, k = 5, 3, 2
    logits = torch.randn(t, e)
    r = routing_from_logits(logits, k)
    routed = expert_counts(r.experts, e)
    f = [sum(int(r.experts[i, j] == x) for i in range(t) for j in range(k)) / (t * k)
         for x in range(e)]
    p = [sum(math.exp(logits[i, x]) / sum(math.exp(logits[i, y]) for y in range(e))
             for i in range(t)) / t for x in range(e)]
    balance = e * sum(f[x] * p[x] for x in range(e))
    z = sum(math.log(sum(math.exp(logits[i, y]) for y in range(e))) ** 2 for i in range(t)) / t
    assert balance_loss(r, routed).item() == pytest.approx(balance, rel=1e-6)
    assert z_loss(r).item() == pytest.approx(z, rel=1e-6)


def test_router_is_fp32_under_autocast():
    tokens, router = torch.randn(6, 16), torch.nn.Linear(16, 4, bias=False)
    w = router.weight.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = route(tokens, router, 2)
    assert r.logits.dtype == torch.float32
    torch.testing.assert_close(r.logits, tokens @ w.T)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(6))


def test_capacity_policies_hand_built():
    # Four tokens, two experts, top-1; all four want expert 0 with these probabilities.
    probs0 = torch.tensor([0.6, 0.9, 0.7, 0.8])
    logits = torch.stack([probs0.log(), (1 - probs0).log()], dim=-1)
    r = routing_from_logits(logits, 1)
    cfg = ModelConfig(n_experts=2, moe_top_k=1, moe_capacity_factor=1.0)
    assert capacity(cfg, 4) == 2  # ceil(1.0 * 4 tokens * 1 / 2 experts)
    x = torch.arange(4.0)[:, None].repeat(1, 8)
    for policy, kept in (("probs", [1, 3]), ("position", [0, 1])):
        xs, d = dispatch(x, r, 2, policy)
        assert sorted(d.token[d.keep].tolist()) == kept, policy
        assert d.counts.tolist() == [2, 0] and d.routed.tolist() == [4, 0]
        out = combine(xs, d, 4)
        assert out[:, 0].tolist() == [float(i in kept) * i for i in range(4)], policy


def _model_grads(cfg: ModelConfig, tokens: torch.Tensor, autocast: torch.dtype | None = None):
    """The model's output and parameter gradients on `tokens`' device (tests/gpu's MoE
    check runs it there), under autocast to `autocast` if given."""
    model = build_model(cfg, device=tokens.device, seed=0)
    with torch.autocast(tokens.device.type, dtype=autocast, enabled=autocast is not None):
        out = model(tokens)
    (out.float().square().mean()).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("factor,policy", [(0.0, "probs"), (1.0, "probs"), (0.5, "position")])
def test_grouped_equals_loop(style, factor, policy):
    base = dict(style=style, dim=64, n_layers=2, n_heads=4, n_experts=4, moe_top_k=2,
                vocab_size=64, max_seq_len=32, moe_capacity_factor=factor,
                moe_drop_policy=policy)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out_g, grads_g = _model_grads(ModelConfig(**base, moe_impl="grouped"), tokens)
    out_l, grads_l = _model_grads(ModelConfig(**base, moe_impl="loop"), tokens)
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
    assert grads_g.keys() == grads_l.keys()
    for name in grads_g:
        assert grads_g[name] is not None, name
        torch.testing.assert_close(grads_g[name], grads_l[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_expert_slices_drawn_by_index():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_experts=4, moe_top_k=2)
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
    w2 = a.layers[0].mlp.experts.w2
    assert not torch.equal(w2[0], w2[1])
    assert torch.equal(w2, b.layers[0].mlp.experts.w2)
    slice2 = init_expert("layers.0.mlp.experts.w2", tuple(w2.shape[1:]), 0, cfg, 2)
    torch.testing.assert_close(slice2, w2[2], rtol=0, atol=0)
    assert w2.std() < 0.7 * a.layers[0].mlp.experts.w1.std()  # the scaled residual init


def _router_grad(coef: float, z_coef: float = 0.0, top_k: int = 2) -> torch.Tensor:
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_experts=4, moe_top_k=top_k,
                      vocab_size=64, max_seq_len=32, moe_aux_loss_coef=coef,
                      moe_z_loss_coef=z_coef)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).mean().backward()
    return model.layers[0].mlp.router.weight.grad


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_task_loss_reaches_the_router(top_k):
    """With the auxiliary losses off the router learns from the task loss alone: through
    the gates. A top-1 gate renormalised over its one choice would be 1 whatever the router
    says (a gradient of ~1e-10, rounding), so top-1 gates by the router probability."""
    assert _router_grad(0.0, top_k=top_k).norm() > 1e-5


def test_aux_losses_reach_the_router():
    plain = _router_grad(0.0)
    assert not torch.allclose(plain, _router_grad(0.01))
    assert not torch.allclose(plain, _router_grad(0.0, 0.001))
    # The added gradient is linear in the coefficient.
    torch.testing.assert_close(_router_grad(0.02) - plain, 2 * (_router_grad(0.01) - plain),
                               rtol=1e-4, atol=1e-9)


def _trainer_router_grad(tmp_path, name: str, global_batch: int, copies: int, coef: float):
    cfg = tiny(tmp_path, name, "--model.n_experts", "4", "--train.global_batch",
               str(global_batch), "--train.micro_batch", "2",
               "--model.moe_aux_loss_coef", str(coef), "--model.moe_z_loss_coef", str(coef))
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    batch = trainer.sampler.next_step()[0]
    trainer.parallel.zero_grad()
    trainer.parallel.forward_backward([batch] * copies)
    return trainer.parallel.module.layers[0].mlp.router.weight.grad.clone()


def test_aux_gradient_scaled_like_the_loss(tmp_path):
    """m = 2 copies of a micro-batch and m = 1 give the same gradient through the executor
    only if the auxiliary gradient is scaled by 1 / m as the loss's is."""
    one = _trainer_router_grad(tmp_path, "m1", 2, 1, 0.5)
    two = _trainer_router_grad(tmp_path, "m2", 4, 2, 0.5)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-7)
    without = _trainer_router_grad(tmp_path, "m1-off", 2, 1, 0.0)
    assert not torch.allclose(one, without, rtol=1e-3, atol=1e-6)
    # And the hook is what scales it: unscaled, the aux part would count twice.
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_experts=4, vocab_size=64, max_seq_len=32,
                      moe_aux_loss_coef=0.5)
    grads = []
    for scale in (0.5, 1.0):
        model = build_model(cfg, seed=0)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            with loss_grad_scale(scale):
                out = model(tokens)
            (out.mean() * 0.5).backward()
        grads.append(model.layers[0].mlp.router.weight.grad)
    single = build_model(cfg, seed=0)
    single(tokens).mean().backward()
    torch.testing.assert_close(grads[0], single.layers[0].mlp.router.weight.grad)
    assert not torch.allclose(grads[1], grads[0])


def test_trainer_logs_moe_stats(tmp_path):
    cfg = tiny(tmp_path, "stats", "--model.n_experts", "4", "--train.steps", "2",
               "--model.moe_capacity_factor", "0.5")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    record = trainer.train_step()
    assert 0 < record["moe_aux_loss"] < cfg.model.n_experts
    assert record["moe_z_loss"] > 0
    # capacity 0.5: each expert takes at most half its fair share: at least half dropped.
    slots = cfg.train.global_batch * cfg.train.seq_len * cfg.model.moe_top_k * cfg.model.n_layers
    assert record["moe_dropped"] >= slots // 2
    assert record["moe_expert_cv"] >= 0
    again = trainer.train_step()  # the stats were reset: one step's, not two
    assert slots // 2 <= again["moe_dropped"] <= slots
    # Full recomputation reruns each block's forward in backward: the same numbers, and
    # the rerun is not counted twice.
    cfg = tiny(tmp_path, "stats-ac", "--model.n_experts", "4", "--train.steps", "2",
               "--model.moe_capacity_factor", "0.5", "--train.activation_checkpointing", "full")
    recomputed = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).train_step()
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped",
                "moe_expert_cv"):
        assert recomputed[key] == pytest.approx(record[key], rel=1e-6), key


@pytest.mark.parametrize("overrides,field", [
    (dict(n_experts=2, moe_top_k=3), "model.moe_top_k"),
    (dict(n_experts=4, moe_aux_loss_coef=-0.1), "model.moe_aux_loss_coef"),
    (dict(n_experts=4, moe_z_loss_coef=-1.0), "model.moe_z_loss_coef"),
    (dict(n_experts=4, moe_capacity_factor=-1.0), "model.moe_capacity_factor"),
    (dict(n_experts=4, moe_drop_policy="random"), "model.moe_drop_policy"),
    (dict(n_experts=4, moe_impl="fast"), "model.moe_impl"),
    (dict(style="gpt2", n_experts=4, dim=60, n_heads=4), "model.moe_impl"),
])
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig(**overrides).validate()


def _moe_records(trainer: Trainer) -> dict:
    """The logged MoE figures per step (rank 0 writes metrics.jsonl)."""
    path = Path(trainer.cfg.train.run_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {"moe": [(r["moe_aux_loss"], r["moe_z_loss"], r["moe_dropped"]) for r in rows]}


def test_moe_parity_dp2_and_pp2(tmp_path):
    """Aux and z losses on (dropless): dp=2 (also with ZeRO-3) and pp=2 train as the single
    process does, and rank 0 logs the same mean aux / z losses (reduced over dp, pp).
    Capacity drops are a discontinuity: an all-reduce's rounding can flip a slot at the
    capacity boundary, so they are checked against the loop implementation on one
    process instead."""
    moe = ("--model.n_experts", "4", "--model.moe_aux_loss_coef", "0.1", "--train.steps", "4")
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *moe, *o))  # noqa: E731
    reference = train_layout(0, 1, text("ref"), _moe_records)
    rows = [("dp2", ()), ("pp2", ("--parallel.pp", "2")),
            ("dp2 zero3", ("--parallel.zero", "3"))]
    per_rank = run_distributed(train_layouts, 2, [text(n, *o) for n, o in rows], _moe_records)
    for i, (label, _) in enumerate(rows):
        for rank, results in enumerate(per_rank):
            assert_parity(reference, results[i], f"moe {label} rank {rank}")
        torch.testing.assert_close(torch.tensor(per_rank[0][i]["moe"]),
                                   torch.tensor(reference["moe"]), rtol=1e-5, atol=0)
