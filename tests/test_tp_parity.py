"""Tensor and sequence parallelism reproduce the single-process run (fp32 losses and final
weights), alone and composed with data parallelism (also with top-k update compression at
ratio 1.0), for the Llama (grouped-query attention, kv heads split or shared) and GPT-2
(tied embeddings) models, with a vocabulary that tp does not divide; and checkpoints are
layout-independent (tp=2 <-> tp=1)."""

from __future__ import annotations

import math

import pytest

from dist import run_distributed
from parity import assert_parity, reference_runs, tiny, train_layout, train_layouts
from shardtrain import config

STEPS = "8"
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
V259 = ("--model.vocab_size", "259")
# Plain SGD without clipping: the average of the dp ranks' local updates (comm.compress=topk
# at ratio 1.0 sends every entry) is then exactly the update of the averaged gradient.
SGD = ("--optim.name", "sgd", "--optim.momentum", "0", "--optim.grad_clip", "0",
       "--train.lr", "0.05")
# (label, model overrides -- the reference run has them too --, layout overrides).
# tiny: 4 heads, 2 kv heads, global batch 8 of micro-batches of 2.
LAYOUTS = {
    2: [("tp2", (), ["--parallel.tp", "2"]),
        ("tp2 sp gpt2 tied vocab 259", (*GPT2, *V259),
         ["--parallel.tp", "2", "--parallel.sp", "true"])],
    4: [("tp4 vocab 259, kv heads shared", V259, ["--parallel.tp", "4"]),
        ("tp2 x dp2", (), ["--parallel.tp", "2"]),
        ("tp2 x dp2 top-k updates, ratio 1.0", SGD,
         ["--parallel.tp", "2", "--comm.compress", "topk", "--comm.topk_ratio", "1.0"]),
        ("tp4 sp activation checkpointing", (), ["--parallel.tp", "4", "--parallel.sp", "true",
                                                 "--train.activation_checkpointing", "full"])],
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("tp")


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, "--checkpoint.every", "4",
                               *overrides))


@pytest.fixture(scope="module")
def references(tmp):
    """Single-process runs by model overrides, each trained once for the module."""
    return reference_runs(lambda name, *overrides: _text(tmp, name, *overrides))


def _resumed_from(reference: dict) -> dict:
    """The reference as seen by a run resumed at step 4."""
    return {**reference, "losses": reference["losses"][4:]}


def _step4(tmp, name: str) -> str:
    return str(tmp / name / "checkpoints" / "step_00000004")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_parity_with_single_process(tmp, references, world_size):
    layouts = LAYOUTS[world_size]
    refs = [references(model) for _, model, _ in layouts]
    texts = [_text(tmp, f"w{world_size}-{i}", *model, *layout)
             for i, (_, model, layout) in enumerate(layouts)]
    if world_size == 2:  # a tp=2 run resumed from the tp=1 reference's step-4 checkpoint
        texts.append(_text(tmp, "tp2-from-tp1", "--parallel.tp", "2",
                           "--checkpoint.resume", _step4(tmp, "ref-0")))
        texts.append(_text(tmp, "tp2-bf16", "--parallel.tp", "2", "--parallel.sp", "true",
                           "--train.precision", "bf16"))
    per_rank = run_distributed(train_layouts, world_size, texts)
    for i, (label, _, _) in enumerate(layouts):
        for rank, results in enumerate(per_rank):
            assert_parity(refs[i], results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
    if world_size == 2:
        for rank, results in enumerate(per_rank):
            assert_parity(_resumed_from(refs[0]), results[-2], f"tp2 from tp1 rank {rank}")
        # ... and a tp=1 run resumed from the tp=2 run's step-4 checkpoint.
        resumed = train_layout(0, 1, _text(tmp, "tp1-from-tp2", "--checkpoint.resume",
                                           _step4(tmp, "w2-0")))
        assert_parity(_resumed_from(refs[0]), resumed, "tp1 from tp2")
        bf16 = per_rank[0][-1]["losses"]  # bf16 activations: close to fp32, not equal
        assert all(math.isfinite(x) for x in bf16)
        assert all(abs(b - f) < 0.05 * f for b, f in zip(bf16, refs[0]["losses"])), bf16
