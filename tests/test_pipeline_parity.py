"""Pipeline parallelism reproduces the single-process run (fp32 losses, eval loss and final
weights): pp = 2 and 4 under GPipe, 1F1B and interleaved 1F1B with 1, 4 and 8 micro-batches
(and ZB-H1 with its split backward; ZB-V and DualPipeV, whose V puts the tied embedding
and head both on stage 0: a ZB-V checkpoint resumes into 1F1B), composed with data and tensor (+ sequence) parallelism and ZeRO-1, up to pp x tp x dp =
2 x 2 x 2 on 8 processes; tied embeddings (GPT-2) across the first and last stage; checkpoints written by a
pipeline resume on one process. Each spawn also measures the activations stage 0 holds and
checks the timeline files."""

from __future__ import annotations

import json
import random

import pytest
from dist import run_distributed
from parity import assert_parity, tiny, train_layout, train_layouts

from shardtrain import config
from shardtrain.parallel.pipeline.schedules import COMPUTE, V_SHAPED, placement
from shardtrain.parallel.pipeline.simulate import simulate
from shardtrain.train.trainer import Trainer

STEPS = "3"
# tiny has 2 layers: 8 make room for pp = 4 x v = 2 (the references use the same model).
BASE = ("--model.n_layers", "8")
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
RECOMPUTE = ("--train.activation_checkpointing", "full")


def _pp(pp: int, schedule: str, m: int, *more: str) -> list[str]:
    v = ["--parallel.virtual_stages", "2"] if schedule in ("interleaved", *V_SHAPED) else []
    return ["--parallel.pp", str(pp), "--parallel.schedule", schedule,
            "--parallel.microbatches", str(m), *v, *more]


def _sweep(pp: int) -> list[tuple[str, tuple, list[str]]]:
    """Each schedule with m in {1, 4, 8}; interleaving needs m a multiple of pp (no m = 1)."""
    return [(f"pp{pp} {s} m{m}", (), _pp(pp, s, m))
            for s in ("gpipe", "1f1b", "interleaved") for m in (1, 4, 8)
            if s != "interleaved" or m % pp == 0]


# world size -> (label, model overrides -- the reference has them too --, layout overrides)
LAYOUTS = {
    2: [*_sweep(2),
        # split backward (test_pipeline_zero_bubble.py has the rest of its rows)
        ("pp2 gpt2 tied zb-h1, full recomputation", GPT2, _pp(2, "zb-h1", 4, *RECOMPUTE)),
        # the V: embedding and tied head both on stage 0 (the rest: test_pipeline_zero_bubble)
        ("pp2 gpt2 tied zbv", GPT2, _pp(2, "zbv", 4, "--checkpoint.every", "2")),
        ("pp2 gpt2 tied dualpipev", GPT2, _pp(2, "dualpipev", 4)),
        # last: the checkpoint resumed below
        ("pp2 gpt2 tied embeddings", GPT2, _pp(2, "1f1b", 4, "--checkpoint.every", "2"))],
    4: [*_sweep(4),
        ("pp2 x dp2", (), _pp(2, "1f1b", 2)),
        ("pp2 x dp2 zero1 gpt2 tied", GPT2, _pp(2, "1f1b", 2, "--parallel.zero", "1")),
        ("pp2 x tp2 gpt2 tied, interleaved", GPT2,
         _pp(2, "interleaved", 2, "--parallel.tp", "2")),
        ("pp2 x tp2 sp, activation checkpointing", (),
         _pp(2, "1f1b", 4, "--parallel.tp", "2", "--parallel.sp", "true",
             "--train.activation_checkpointing", "full"))],
    8: [("pp2 x tp2 x dp2", (), _pp(2, "1f1b", 2, "--parallel.tp", "2")),
        ("pp2 x tp2 x dp2 zero1", (), _pp(2, "1f1b", 2, "--parallel.tp", "2",
                                          "--parallel.zero", "1")),
        ("pp2 x tp2 x dp2 zero3 (3D + ZeRO-3)", (), _pp(2, "1f1b", 2, "--parallel.tp", "2",
                                                       "--parallel.zero", "3"))],
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """The module's directory, with a small corpus file: every Trainer fingerprints its data
    source, and walking the standard library's tree costs seconds per process."""
    path = tmp_path_factory.mktemp("pp")
    words = [f"w{i}" for i in range(300)]
    rng = random.Random(0)
    (path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    return path


def _cfg(tmp, name: str, *overrides: str) -> config.Config:
    return tiny(tmp, name, "--train.steps", STEPS, "--data.source", str(tmp / "corpus.txt"),
                *BASE, *overrides)


@pytest.fixture(scope="module")
def references(tmp):
    """Single-process runs by (model overrides, micro-batch size): the eval batches are
    micro-batch sized, so a layout is compared with the reference of its micro-batch."""
    cache: dict[tuple, dict] = {}

    def get(model: tuple, micro_batch: int) -> dict:
        key = (model, micro_batch)
        if key not in cache:
            cfg = _cfg(tmp, f"ref-{len(cache)}", *model, "--train.micro_batch", str(micro_batch),
                       "--checkpoint.every", "2")
            cache[key] = {**train_layout(0, 1, config.to_toml(cfg)),
                          "step2": f"{cfg.train.run_dir}/checkpoints/step_00000002"}
        return cache[key]

    return get


def _pipeline_figures(trainer: Trainer) -> dict:
    """Stage 0's activation peak, the micro-batch size and the point-to-point bytes."""
    sent = {tag: sum(r.sent_bytes for r in trainer.mesh.ledger.records if r.tag == tag)
            for tag in ("pp_act", "pp_grad")}
    return {"peak_live": trainer.parallel.pipeline.peak_live,
            "micro_batch": trainer.cfg.train.micro_batch, "sent": sent}


def _check_order(cfg: config.Config, world_size: int) -> None:
    """The executor ran its computes (F, B, W) in the simulator's order for its stage
    (slots counted, not seconds: parallel/pipeline/simulate.py)."""
    p = cfg.parallel
    sim = simulate(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    for rank in range(world_size):
        with open(f"{cfg.train.run_dir}/timeline_rank{rank}.json") as f:
            t = json.load(f)
        ran = [(a["op"], a["mb"], a["chunk"]) for a in t["actions"] if a["op"] in COMPUTE]
        assert ran == [(a.op, a.mb, a.chunk) for a in sim.order(t["stage"])], (p, rank)
        if p.schedule == "zb-h1":  # the backward was split
            assert ran.count(("W", 0, 0)) == 1, rank


def _check_timelines(cfg: config.Config, world_size: int) -> None:
    p = cfg.parallel
    for rank in range(world_size):
        path = f"{cfg.train.run_dir}/timeline_rank{rank}.json"
        with open(path) as f:
            t = json.load(f)
        assert (t["pp"], t["microbatches"], t["virtual_stages"], t["schedule"], t["step"]) == \
            (p.pp, p.microbatches, p.virtual_stages, p.schedule, int(STEPS)), path
        ops = [a["op"] for a in t["actions"]]
        assert ops.count("F") == ops.count("B") == p.microbatches * p.virtual_stages
        assert all(0 <= a["start"] <= a["end"] for a in t["actions"])


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_pipeline_parity_with_single_process(tmp, references, world_size):
    layouts = LAYOUTS[world_size]
    cfgs = [_cfg(tmp, f"w{world_size}-{i}", *model, *layout)
            for i, (_, model, layout) in enumerate(layouts)]
    texts = [config.to_toml(c) for c in cfgs]
    if world_size == 2:  # pp = 2 resumes from the one-process run's step-2 checkpoint, and
        # 1F1B from ZB-V's (the V's stage 0 holds layers 0-1 and 6-7, 1F1B's 0-3)
        texts.append(config.to_toml(_cfg(tmp, "pp2-from-pp1", *GPT2, *_pp(2, "1f1b", 4),
                                         "--checkpoint.resume", references(GPT2, 2)["step2"])))
        zbv = next(i for i, row in enumerate(layouts) if row[0] == "pp2 gpt2 tied zbv")
        texts.append(config.to_toml(_cfg(
            tmp, "1f1b-from-zbv", *GPT2, *_pp(2, "1f1b", 4), "--checkpoint.resume",
            f"{cfgs[zbv].train.run_dir}/checkpoints/step_00000002")))
    per_rank = run_distributed(train_layouts, world_size, texts, _pipeline_figures)
    for i, (label, model, _) in enumerate(layouts):
        reference = references(model, per_rank[0][i]["micro_batch"])
        for rank, results in enumerate(per_rank):
            assert_parity(reference, results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
        _check_order(cfgs[i], world_size)
    _check_timelines(cfgs[0], world_size)
    if world_size == 4:  # activations held on stage 0 (rank 0), measured by the executor
        peaks = {label: per_rank[0][i]["peak_live"] for i, (label, _, _) in enumerate(layouts)}
        assert peaks["pp4 gpipe m8"] == 8 and peaks["pp4 1f1b m8"] == 4, peaks
        print(f"stage 0 peak micro-batches in flight: {peaks}")
    if world_size == 2:  # the ledger counts every activation and gradient sent across stages
        for i, (label, _, _) in enumerate(layouts):
            m, mb = cfgs[i].parallel.microbatches, per_rank[0][i]["micro_batch"]
            act = mb * cfgs[i].train.seq_len * cfgs[i].model.dim * 4  # fp32 [mb, seq, dim]
            p = cfgs[i].parallel
            place = placement(p.schedule, p.pp, p.virtual_stages)
            evals = cfgs[i].train.eval_batches  # forward only, one batch each
            for stage in (0, 1):  # chunks whose output / input gradient leaves the rank
                sent = per_rank[stage][i]["sent"]
                acts, grads = (sum(place.sends(stage, c, op) for c in range(p.virtual_stages))
                               for op in "FB")
                assert sent["pp_act"] == (int(STEPS) * m + evals) * acts * act, label
                assert sent["pp_grad"] == int(STEPS) * m * grads * act, label
    if world_size == 2:  # checkpoints are layout-independent: pp = 2 <-> one process
        reference = references(GPT2, 2)
        last_step = {**reference, "losses": reference["losses"][2:]}
        for rank, results in enumerate(per_rank):
            assert_parity(last_step, results[-2], f"pp2 from pp1 rank {rank}")
            assert_parity(last_step, results[-1], f"1f1b from zbv rank {rank}")
        ckpt = cfgs[-1].train.run_dir + "/checkpoints/step_00000002"
        resumed = train_layout(0, 1, config.to_toml(_cfg(tmp, "pp1-from-pp2", *GPT2,
                                                         "--checkpoint.resume", ckpt)))
        assert_parity(last_step, resumed, "pp1 from pp2")
