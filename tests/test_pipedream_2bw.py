"""PipeDream-2BW (parallel/pipeline/pipedream.py): the schedule across step boundaries is
valid and idles only in the first fill and the last drain; the config refuses what it does
not compose with; the planner never proposes it; and a pipeline run matches its own
single-process reference -- one process applying W(t+1) = W(t) - lr * g(W(t-1)) with the
same optimizer, seed and batches (`delayed_reference`) -- at fp32 rtol 1e-5 (losses) and
1e-4 (weights) -- bf16 within parity.py's bound --, while differing from synchronous
training by design; a run resumed from its checkpoint continues on the stashed version, as
the uninterrupted run does."""

from __future__ import annotations

import random

import pytest
import torch
from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, make_mesh, tiny, train_layouts,
                    worst_loss_deviation)

from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.parallel.pipeline import schedules
from shardtrain.parallel.pipeline.pipedream import BATCHES, pipedream_2bw, versions_live
from shardtrain.parallel.pipeline.schedules import one_f_one_b
from shardtrain.parallel.pipeline.simulate import simulate
from shardtrain.parallel.pipeline.validate import validate
from shardtrain.plan.layout_checks import SCHEDULES as PLANNED
from shardtrain.plan.layout import Layout, PlanError, check
from shardtrain.train.trainer import Trainer

STEPS = "4"


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8)])
def test_schedule_is_valid_and_idles_only_in_fill_and_drain(pp, m):
    plan = schedules.build("pipedream-2bw", pp, m)
    validate(plan, pp, BATCHES * m, bound=schedules.activation_bound("pipedream-2bw", pp, m))
    for rank in plan:  # every micro-batch of both batches, forward and backward once
        assert sorted(a.mb for a in rank if a.op == "F") == list(range(BATCHES * m))
    sim, flushed = simulate("pipedream-2bw", pp, m), simulate("1f1b", pp, m)
    # F=1, B=2: 1F1B idles (p-1)(F+B) per rank in every step; 2BW that once for both
    # batches -- the boundary between them costs nothing.
    assert sim.idle == [3 * (pp - 1)] * pp == flushed.idle
    assert sim.span == BATCHES * 3 * m + 3 * (pp - 1)
    assert max(sim.peak_activations) == pp


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 3), (4, 4), (4, 6), (8, 8)])
def test_two_versions_suffice_across_steps(pp, m):
    """Over 4 batches every rank needs at most 2 weight versions at once, and no batch
    starts before its version exists; with m < pp a batch would (the config refuses it)."""
    for rank in pipedream_2bw(pp, m, batches=4):
        assert versions_live([(a.op, a.mb) for (a,) in rank], m) == 2
    too_few = one_f_one_b(4, 4)[0]  # m = 1 < pp = 4
    with pytest.raises(ValueError, match="starts before"):
        versions_live([(a.op, a.mb) for (a,) in too_few], 1)


def _base(tmp, name: str, *overrides: str) -> config.Config:
    return tiny(tmp, name, "--train.steps", STEPS, "--data.source", str(tmp / "corpus.txt"),
                *overrides)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """A small corpus (a Trainer fingerprints its data source: the stdlib's tree is slow)."""
    path = tmp_path_factory.mktemp("pd")
    words = [f"w{i}" for i in range(300)]
    rng = random.Random(0)
    (path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    return path


@pytest.mark.parametrize("overrides,field", [
    (("--parallel.pp", "1"), "parallel.pp=1"),
    (("--parallel.pp", "2", "--parallel.microbatches", "1"), "parallel.microbatches=1"),
    (("--parallel.pp", "2", "--parallel.dp", "2", "--parallel.zero", "1"), "parallel.zero=1"),
    (("--parallel.pp", "2", "--parallel.tp", "2"), "parallel.tp=2"),
])
def test_config_refuses_what_it_does_not_compose_with(tmp, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg = _base(tmp, "bad", "--parallel.schedule", "pipedream-2bw", *overrides)
        cfg.validate(cfg.parallel.pp * cfg.parallel.tp * max(cfg.parallel.dp, 1))


def test_planner_never_proposes_it():
    """Its numbers differ from synchronous training by design (docs/planner.md): the
    search draws its schedules from PLANNED, and a layout naming it is refused."""
    assert "pipedream-2bw" in schedules.SCHEDULES and "pipedream-2bw" not in PLANNED
    lay = Layout(pp=2, microbatches=4, schedule="pipedream-2bw")
    with pytest.raises(PlanError, match="schedule='pipedream-2bw'"):
        check(lay, config.load("tiny", []).model, gpus=2, node_size=2, global_batch=8,
              seq_len=32)


def delayed_reference(cfg_text: str) -> dict:
    """The 2BW rule on one process: step t's gradients are those of its batch at W(t-1)
    (W(-1) = W(0)), applied to W(t) by the trainer's own optimizer, clipping and lr."""
    cfg = config.loads(cfg_text)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    params = [p for p in trainer.parallel.module.parameters() if p.requires_grad]
    older = [p.detach().clone() for p in params]  # W(t-1)
    synchronous = trainer.parallel.forward_backward

    def on_older_version(*args, **kwargs):
        nonlocal older
        now = [p.detach().clone() for p in params]  # W(t)
        with torch.no_grad():
            for p, w in zip(params, older):
                p.copy_(w)
        loss = synchronous(*args, **kwargs)  # gradients at W(t-1)
        with torch.no_grad():
            for p, w in zip(params, now):
                p.copy_(w)
        older = now
        return loss

    trainer.parallel.forward_backward = on_older_version
    result = trainer.run()
    return {"losses": result.losses, "eval_loss": result.eval_loss,
            "weights": trainer.parallel.full_state_dict()}


GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
PP2, PP4, DP2 = (("--parallel.pp", "2", "--parallel.microbatches", "4"),
                 ("--parallel.pp", "4", "--parallel.microbatches", "4"),
                 ("--parallel.pp", "2", "--parallel.dp", "2", "--parallel.microbatches", "4"))
# group -> (world size, rows: (label, model overrides, layout overrides, the reference's
# micro-batches: the same micro-batch size, so the same eval batches))
ROWS = {"pp2": (2, [("pp2 m4", (), (*PP2, "--checkpoint.every", "2"), "4")]),
        "pp2 gpt2": (2, [("pp2 m4 gpt2 tied", GPT2, PP2, "4"),
                         ("pp2 m4 bf16", ("--train.precision", "bf16"), PP2, "4")]),
        "4 ranks": (4, [("pp4 m4", ("--model.n_layers", "4"), PP4, "4"),
                        ("pp2 x dp2 m4", (), DP2, "8")])}


# pp2 costs ~1 s once the session's forkserver runs (~7 s alone): the README's tier.
@pytest.mark.parametrize("group", ["pp2",
                                   pytest.param("pp2 gpt2", marks=pytest.mark.slow),
                                   pytest.param("4 ranks", marks=pytest.mark.slow)])
def test_matches_its_single_process_reference(tmp, group):
    world_size, rows = ROWS[group]
    cfgs = [_base(tmp, f"{group}-{i}", *model, *layout, "--parallel.schedule", "pipedream-2bw")
            for i, (_, model, layout, _) in enumerate(rows)]
    texts = [config.to_toml(c) for c in cfgs]
    if group == "pp2":  # resumed from step 2: the checkpoint holds both versions
        texts.append(config.to_toml(_base(
            tmp, "pp2-resumed", *PP2, "--parallel.schedule", "pipedream-2bw",
            "--checkpoint.resume", f"{cfgs[0].train.run_dir}/checkpoints/step_00000002")))
    per_rank = run_distributed(train_layouts, world_size, texts)
    for i, (label, model, _, m) in enumerate(rows):
        ref = config.to_toml(_base(tmp, f"ref {group}-{i}", *model, "--parallel.microbatches", m))
        reference = delayed_reference(ref)
        for rank, results in enumerate(per_rank):
            if "bf16" in label:  # parity.py's bf16 bound on the losses
                worst = worst_loss_deviation(reference["losses"], results[i]["losses"])
                assert worst <= BF16_LOSS_RTOL[False], (label, worst)
            else:
                assert_parity(reference, results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in reference['losses']]}")
        if label == "pp2 m4":  # steps 3 and 4 again, on the stashed W(1) then W(2)
            for results in per_rank:
                later = {**results[0], "losses": results[0]["losses"][2:]}
                assert_parity(later, results[-1], "pp2 m4 resumed at step 2")
        if label == "pp2 m4 gpt2 tied":  # the reference is not synchronous training in disguise
            sync = train_layouts(0, 1, [ref.replace("ref pp2", "sync pp2")])[0]
            # step 0 computes on W(0) in both; from step 1 on the gradient is a version old
            assert sync["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6)
            assert all(s != pytest.approx(r, rel=1e-6)
                       for s, r in zip(sync["losses"][1:], reference["losses"][1:]))
