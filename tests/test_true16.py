"""16-bit training without a master copy (train.precision = bf16-true | fp16-true,
parallel/true16.py), in one process: the roundings of optim.bf16_update, what a run holds
(16-bit parameters and gradients, fp32 moments, no master), the config's refusals, the
planner's 12 bytes per parameter (seed 004) and resuming across precisions. (The layouts'
parity and a resume in another layout: tests/test_true16_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from parity import checkpoint_tensors, make_mesh, tiny
from shardtrain.config import ConfigError
from shardtrain.plan.layout import (Layout, PlanError, check, config_layout, layout_config,
                                    trainer_refusal)
from shardtrain.plan.memory import memory_per_gpu, model_states
from shardtrain.parallel.true16 import stochastic_bf16, update_16bit
from shardtrain.train.trainer import Trainer

ULP = 2.0**-7  # bf16's spacing in [1, 2)


def test_stochastic_rounding_is_unbiased():
    """The mean of many roundings of a value between two bf16 neighbours is the value;
    nearest rounding would give the nearer neighbour every time. Values bf16 holds stay."""
    g = torch.Generator().manual_seed(0)
    for value in (1 + ULP / 8, -(1 + 3 * ULP / 4), 3e-5 * (1 + ULP / 3)):
        x = torch.full((200_000,), value)  # [n] fp32
        r = stochastic_bf16(x, g)
        assert r.dtype == torch.bfloat16
        lo, hi = sorted({v.item() for v in r.float().unique()})  # the two neighbours only
        assert lo < value < hi
        spacing = hi - lo
        # 4 standard deviations of the mean of n Bernoulli draws, in units of the spacing
        assert abs(r.float().double().mean().item() - value) < 4 * spacing / 200_000**0.5
        assert x.to(torch.bfloat16).float().unique().numel() == 1  # nearest: one neighbour
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])
    assert torch.equal(stochastic_bf16(exact, g).float(), exact)


def _drift(mode: str, steps: int = 1000, delta: float = 1e-4) -> float:
    """A bf16 weight at 1.0 moved by `delta` `steps` times (each under half an ulp)."""
    w = torch.ones(64, dtype=torch.bfloat16)
    comp = torch.zeros_like(w)
    for step in range(steps):
        update_16bit(w, lambda x: x.add_(delta), mode=mode, seed=step, compensation=comp)
    return w.float().mean().item()


def test_kahan_and_stochastic_keep_updates_below_bf16_resolution():
    """1000 updates of 1e-4 (an eightieth of bf16's ulp at 1.0): nearest rounding loses
    every one, Kahan's compensation keeps their sum to within an ulp, stochastic rounding
    on average."""
    want = 1.0 + 1000 * 1e-4
    assert _drift("nearest") == 1.0
    assert abs(_drift("kahan") - want) <= ULP
    assert abs(_drift("stochastic") - want) <= 2 * ULP


def _trainer(tmp_path, name: str, *overrides: str) -> Trainer:
    cfg = tiny(tmp_path, name, "--train.steps", "2", *overrides)
    cfg.validate(1)
    return Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))


@pytest.mark.parametrize("precision,update,dtype", [("bf16-true", "kahan", torch.bfloat16),
                                                    ("fp16-true", "nearest", torch.float16)])
def test_a_run_holds_16_bit_weights_and_gradients_and_fp32_moments(tmp_path, precision,
                                                                   update, dtype):
    trainer = _trainer(tmp_path, precision, "--train.precision", precision,
                       "--optim.bf16_update", update)
    record = trainer.train_step()
    params = list(trainer.parallel.module.parameters())
    psi = sum(p.numel() for p in params)
    assert {p.dtype for p in params} == {dtype} and {p.grad.dtype for p in params} == {dtype}
    states = trainer.parallel.update.optimizer.state
    moments = [s[n] for s in states.values() for n in ("exp_avg", "exp_avg_sq")]
    assert {m.dtype for m in moments} == {torch.float32}
    kahan = 2 * psi if update == "kahan" else 0  # the compensation, in the weights' dtype
    assert record["params_bytes"] == 2 * psi and record["master_bytes"] == 0
    assert record["optimizer_bytes"] == 8 * psi + kahan + 4 * len(params)  # + AdamW's steps
    assert record["loss_scale"] == (65536.0 if precision == "fp16-true" else 1.0)


@pytest.mark.parametrize("overrides,field", [
    (("--train.precision", "bf16", "--optim.bf16_update", "stochastic"), "optim.bf16_update"),
    (("--train.precision", "fp16-true", "--optim.bf16_update", "kahan"), "optim.bf16_update"),
    (("--train.precision", "bf16-true", "--parallel.zero", "2", "--parallel.offload", "cpu"),
     "parallel.offload"),
    (("--train.precision", "bf16-true", "--optim.name", "adamw8bit"), "optim.name"),
    (("--train.precision", "fp16-true", "--parallel.ps_servers", "1"), "parallel.ps_servers"),
    (("--train.precision", "bf16-true", "--lora.rank", "4", "--lora.quantize_base", "nf4"),
     "lora.quantize_base"),
])
def test_what_keeps_an_fp32_weight_copy_is_refused_naming_the_field(tmp_path, overrides,
                                                                    field):
    with pytest.raises(ConfigError, match=field):
        tiny(tmp_path, "bad", *overrides).validate(2)


def test_planner_counts_seed_004s_12_bytes_per_parameter(tmp_path):
    """Seed 004: 7B parameters in bf16 with bf16 gradients and fp32 Adam moments, no
    master: 14 + 14 + 56 = 84 GB of model states; Kahan's compensation adds 14 GB."""
    states = model_states(7e9, precision="bf16-true")
    assert (states.params, states.grads, states.master, states.optimizer) == (
        14e9, 14e9, 0, 56e9)
    assert states.total == 84e9 == model_states(7e9, precision="fp16-true").total
    assert model_states(7e9, precision="bf16-true", compensation=2).total == 98e9
    z3 = model_states(7e9, nd=8, zero=3, precision="bf16-true", compensation=2)
    assert z3.total == 98e9 / 8
    # The layout round trip: a config's layout, and the config a layout runs.
    cfg = tiny(tmp_path, "plan", "--train.precision", "bf16-true", "--optim.bf16_update",
               "kahan", "--parallel.zero", "2", "--train.global_batch", "16")
    cfg.validate(2)
    lay = config_layout(cfg, 2)
    assert (lay.precision, lay.bf16_update) == ("bf16-true", "kahan")
    back = layout_config(lay, cfg.model, seq_len=cfg.train.seq_len)
    assert (back.train.precision, back.optim.bf16_update) == ("bf16-true", "kahan")
    plan = memory_per_gpu(cfg.model, lay, seq_len=cfg.train.seq_len)
    assert plan.master == 0 and plan.params == 2 * plan.grads  # 16-bit; zero=2 over 2
    # the planner proposes nothing the trainer refuses: ZeRO-Offload keeps an fp32 master
    assert "parallel.offload" in trainer_refusal(
        Layout(dp=2, zero=2, offload="cpu", precision="bf16-true", micro_batch=8),
        cfg.model, seq_len=cfg.train.seq_len)
    with pytest.raises(PlanError, match="bf16_update"):
        check(Layout(precision="amp", bf16_update="kahan"), cfg.model, gpus=1, node_size=1,
              global_batch=1, seq_len=cfg.train.seq_len)


@pytest.mark.parametrize("first,second", [("bf16", "bf16-true"), ("bf16-true", "bf16")])
def test_resume_across_precisions_casts_the_weights(tmp_path, first, second):
    """Checkpoints hold fp32 tensors: bf16-true's weights upcast exactly into a mixed run's
    fp32 ones; a mixed run's fp32 weights round to nearest into bf16-true's (stated in
    docs/precision.md). The moments carry over in fp32 either way."""
    a = _trainer(tmp_path, "a", "--train.precision", first, "--checkpoint.every", "2")
    a.run()
    path = tmp_path / "a" / "checkpoints" / "step_00000002"
    saved = checkpoint_tensors(path)
    cfg = tiny(tmp_path, "b", "--train.steps", "3", "--train.precision", second,
               "--checkpoint.resume", str(path))
    b = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    dtype = torch.bfloat16 if second == "bf16-true" else torch.float32
    for name, p in b.parallel.module.named_parameters():
        assert p.dtype == dtype and torch.equal(p.detach(), saved[name].to(dtype)), name
    moments = checkpoint_tensors(path, "optim/")
    state = b.parallel.update.optimizer.state
    for name, p in b.parallel.module.named_parameters():
        assert torch.equal(state[p]["exp_avg"], moments[f"{name}/exp_avg"]), name
    assert b.step == 2 and all(map(torch.isfinite, torch.tensor(b.run().losses)))
