"""Resharding: a checkpoint written by one layout resumes in another.

Each row trains 4 steps in layout A (checkpoint at step 2), resumes step 2 in layout B and
trains to step 4; A's losses and B's steps 3-4 must equal the single-process run's (fp32
harness tolerances), and B's final weights too. The rows are the issue's: dp=4 ZeRO-3 ->
tp=2 x pp=2 (GPT-2 with tied embeddings, whose head lives on the last stage there);
pp=2 x dp=2 ZeRO-1 -> dp=2 ZeRO-2; tp=2 x dp=2 -> one process; one process -> dp=4 ZeRO-1
with cpu offload; dp=4 -> dp=2, the sampler's position carried over; and two beyond them:
context parallelism (cp=2 x dp=2 -> tp=2) and expert parallelism (a mixture of experts,
ep=2 x dp=2 -> one process). The checkpoint's I/O is checked on the way: plain dp=4's
files balanced over its ranks, and each rank of a resumed ZeRO-3 dp=4 (as itself, and as
tp=2 x pp=2) reading the values of at most 1.25x the bytes it needs (each chunk read
adds its torch.save framing, printed beside).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

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
    "dp4 zero3 -> dp4 zero3": ((), (Z, "3"), 4, (Z, "3"), 4),
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
    ref_names = {model: f"ref {i}" for i, model in enumerate({row[0] for row in ROWS.values()})}
    refs = {model: train_layout(0, 1, _text(tmp_path, name, *model))
            for model, name in ref_names.items()}
    results: dict[str, dict] = {}
    reads: dict[str, list[dict]] = {}  # per rank of a resumed layout: bytes read, needed
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
        ranks = run_distributed(train_layouts, world, texts, _resume_bytes)
        results.update(zip(names, ranks[0]))  # rank 0's: the losses agree
        reads.update({n: [r[i]["resume_bytes"] for r in ranks] for i, n in enumerate(names)})
    for label, row in ROWS.items():
        if row[4] == 1:
            results[f"B {label}"] = train_layout(0, 1, _resumed(tmp_path, label))

    for label, (model, *_rest) in ROWS.items():
        ref = refs[model]
        assert_parity(ref, results[f"A {label}"], f"A of {label}")
        tail = {**ref, "losses": ref["losses"][2:]}
        assert_parity(tail, results[f"B {label}"], f"B of {label}")

    # DCP's own converter reads a tp=2 x dp=2 checkpoint into the single-process weights.
    whole_ref = _whole(tmp_path / ref_names[()] / "checkpoints" / "step_00000002", tmp_path)
    whole_tp = _whole(tmp_path / "A tp2 x dp2 -> one process" / "checkpoints" /
                      "step_00000002", tmp_path)
    weights = [k for k in whole_ref if k.startswith("model/")]
    assert weights and sorted(weights) == sorted(k for k in whole_tp if k.startswith("model/"))
    for k in weights:
        torch.testing.assert_close(whole_tp[k], whole_ref[k], rtol=1e-4, atol=1e-4)

    # DCP's save planner spreads the replicas of plain dp=4 over the ranks holding them.
    step2 = tmp_path / "A dp4 -> dp2" / "checkpoints" / "step_00000002"
    sizes = [sum(f.stat().st_size for f in step2.glob(f"__{r}_*.distcp")) for r in range(4)]
    print(f"  dp=4 .distcp bytes per rank: {sizes}, max/mean "
          f"{max(sizes) / (sum(sizes) / 4):.3f}")
    assert max(sizes) <= 1.25 * sum(sizes) / 4
    # A resuming rank reads the stored chunks overlapping what it holds: about its share.
    for label in ("dp4 zero3 -> dp4 zero3", "dp4 zero3 -> tp2 x pp2"):
        got = reads[f"B {label}"]
        print(f"  {label}: per rank, values read / needed "
              + ", ".join(f"{r['values'] / r['needed']:.3f}" for r in got)
              + "; file bytes read / needed "
              + ", ".join(f"{r['read'] / r['needed']:.3f}" for r in got))
        assert max(r["values"] / r["needed"] for r in got) <= 1.25, (label, got)


def _whole(path, tmp) -> dict:
    """A checkpoint as DCP's own tool converts it: one file of whole tensors."""
    out = tmp / f"{path.parent.parent.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)


def _resume_bytes(trainer) -> dict:
    return {"resume_bytes": trainer.resume_bytes}


@pytest.fixture
def saved(tmp_path):
    """A one-process run's checkpoint at step 2 of 4."""
    train_layout(0, 1, _text(tmp_path, "saved"))
    return tmp_path / "saved" / "checkpoints" / "step_00000002"
