"""Resharding: a checkpoint written by one layout resumes in another.

Each row trains 4 steps in layout A (checkpoint at step 2), resumes step 2 in layout B and
trains to step 4; A's losses and B's steps 3-4 must equal the single-process run's (fp32
harness tolerances), and B's final weights too. The rows are the issue's: dp=4 ZeRO-3 ->
tp=2 x pp=2 (GPT-2 with tied embeddings, whose head lives on the last stage there);
pp=2 x dp=2 ZeRO-1 -> dp=2 ZeRO-2; tp=2 x dp=2 -> one process; one process -> dp=4 ZeRO-1
with cpu offload; dp=4 -> dp=2, the sampler's position carried over; and two beyond them:
context parallelism (cp=2 x dp=2 -> tp=2) and expert parallelism (a mixture of experts,
ep=2 x dp=2 -> one process).
"""

from __future__ import annotations

import pytest

from dist import run_distributed
from parity import assert_parity, tiny, train_layout, train_layouts
from shardtrain import config

STEPS = ("--train.steps", "4", "--train.global_batch", "8", "--checkpoint.every", "2")
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
MOE = ("--model.n_experts", "4", "--model.moe_aux_loss_coef", "0.1",
       "--model.moe_z_loss_coef", "0.01")
Z = "--parallel.zero"
# label: (model, layout A, world A, layout B, world B)
ROWS = {
    "dp4 zero3 -> tp2 x pp2": (GPT2, (Z, "3"), 4, ("--parallel.tp", "2", "--parallel.pp", "2"), 4),
    "pp2 x dp2 zero1 -> dp2 zero2": ((), ("--parallel.pp", "2", Z, "1"), 4, (Z, "2"), 2),
    "tp2 x dp2 -> one process": ((), ("--parallel.tp", "2"), 4, (), 1),
    "one process -> dp4 zero1 offload": ((), (), 1, (Z, "1", "--parallel.offload", "cpu"), 4),
    "dp4 -> dp2": ((), (), 4, (), 2),
    "cp2 x dp2 -> tp2": ((), ("--parallel.cp", "2"), 4, ("--parallel.tp", "2"), 2),
    "ep2 x dp2 -> one process": (MOE, ("--parallel.ep", "2"), 4, (), 1),
}


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, *STEPS, *overrides))


def _resumed(tmp, label: str) -> str:
    model, _, _, layout, _ = ROWS[label]
    step2 = str(tmp / f"A {label}" / "checkpoints" / "step_00000002")
    return _text(tmp, f"B {label}", *model, *layout, "--checkpoint.resume", step2)


def test_resume_in_another_layout(tmp_path):
    refs = {model: train_layout(0, 1, _text(tmp_path, f"ref {i}", *model))
            for i, model in enumerate({row[0] for row in ROWS.values()})}
    results: dict[str, dict] = {}
    for label, (model, layout, world, _, _) in ROWS.items():  # layouts A
        if world == 1:
            results[f"A {label}"] = train_layout(0, 1, _text(tmp_path, f"A {label}", *model,
                                                             *layout))
    # One spawn per world size, in order: what a layout writes is there for the next.
    four = [f"A {label}" for label, row in ROWS.items() if row[2] == 4] + \
        [f"B {label}" for label, row in ROWS.items() if row[4] == 4]
    two = [f"B {label}" for label, row in ROWS.items() if row[4] == 2]
    for world, names in ((4, four), (2, two)):
        texts = [_text(tmp_path, n, *ROWS[n[2:]][0], *ROWS[n[2:]][1]) if n[0] == "A"
                 else _resumed(tmp_path, n[2:]) for n in names]
        out = run_distributed(train_layouts, world, texts)[0]  # rank 0's: the losses agree
        results.update(zip(names, out))
    for label, row in ROWS.items():
        if row[4] == 1:
            results[f"B {label}"] = train_layout(0, 1, _resumed(tmp_path, label))

    for label, (model, *_rest) in ROWS.items():
        ref = refs[model]
        assert_parity(ref, results[f"A {label}"], f"A of {label}")
        tail = {**ref, "losses": ref["losses"][2:]}
        assert_parity(tail, results[f"B {label}"], f"B of {label}")


@pytest.fixture
def saved(tmp_path):
    """A one-process run's checkpoint at step 2 of 4."""
    train_layout(0, 1, _text(tmp_path, "saved"))
    return tmp_path / "saved" / "checkpoints" / "step_00000002"
