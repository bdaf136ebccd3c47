"""Multi-token prediction's parity rows (model/mtp.py): against one process, the same
per-step main and depth losses and final weights (the modules and the token table
included) under pp=2 (the last stage's modules and table copy), tp=2 with sp (the
row-parallel projection, the vocab-parallel head and loss), cp=2, dp=2 x ZeRO-2 and
ZeRO-3 (with and without a pipeline) and ep=2 on a mixture of experts, fp32 and bf16; a
checkpoint resumes across a layout change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtrain import config
from shardtrain.train.trainer import Trainer

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, LOSS_RTOL, assert_parity, tiny, train_layout, train_layouts,
                    worst_loss_deviation)

MTP = ("--model.mtp_depth", "2", "--model.mtp_loss_coef", "0.3", "--train.steps", "4",
       "--checkpoint.every", "2", "--checkpoint.keep", "2")
MOE = ("--model.n_experts", "4", "--model.moe_score", "sigmoid", "--model.moe_balance", "bias",
       "--model.moe_aux_loss_coef", "0.001")
BF16 = ("--train.precision", "bf16")
TP_SP = ("--parallel.tp", "2", "--parallel.sp", "true")


def depth_losses(trainer: Trainer) -> dict:
    """Each step's depth losses as rank 0 wrote them (metrics.jsonl); other ranks: none."""
    if not trainer.is_main:
        return {"mtp": None}
    path = Path(trainer.cfg.train.run_dir) / "metrics.jsonl"
    return {"mtp": [json.loads(line)["mtp_losses"] for line in path.read_text().splitlines()]}


def check_rows(text, rows: list[tuple[str, tuple[str, ...]]], world: int = 2) -> dict:
    """Train `rows` (label, overrides) on `world` ranks and assert each against the one
    process run of its precision: fp32 to the parity bounds (losses, depth losses, weights),
    bf16 to the bf16 loss bound (main and depth losses). Returns the fp32 reference."""
    refs = {False: train_layout(0, 1, text("ref"), depth_losses),
            True: train_layout(0, 1, text("ref16", *BF16), depth_losses)}
    per_rank = run_distributed(train_layouts, world,
                               [text(n.replace(" ", "-"), *o) for n, o in rows], depth_losses)
    for i, (label, _) in enumerate(rows):
        bf16, ref = "bf16" in label, refs["bf16" in label]
        got = [results[i] for results in per_rank]
        depths = torch.tensor(got[0]["mtp"]).T  # [D, steps]
        for k, want in enumerate(torch.tensor(ref["mtp"]).T):
            worst = worst_loss_deviation(want.tolist(), depths[k].tolist())
            assert worst <= (BF16_LOSS_RTOL["tp" in label] if bf16 else LOSS_RTOL), (label, k)
        for rank, result in enumerate(got):
            if bf16:
                worst = worst_loss_deviation(ref["losses"], result["losses"])
                assert worst <= BF16_LOSS_RTOL["tp" in label], (label, rank, worst)
            else:
                assert_parity(ref, result, f"{label} rank {rank}")
    return refs[False]


def test_mtp_parity_pp2_tp2_sp_cp2_on_packed_documents(tmp_path):
    """The layouts that move the modules or split the rows, on packed documents: the last
    pipeline stage (its table copy's gradient summed with the first stage's), the
    tensor-parallel split, and context parallelism (each rank's depth inputs and targets
    from the whole rows, the row's end on one rank)."""
    docs = ("--data.document_mask", "true")
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *MTP, *docs, *o))  # noqa
    check_rows(text, [("pp2", ("--parallel.pp", "2")), ("tp2 sp", TP_SP),
                      ("cp2", ("--parallel.cp", "2"))])


@pytest.mark.slow  # two 2-rank spawns of eight rows, one process resumed (~50 s loaded)
def test_mtp_parity_rows_and_resume(tmp_path):
    """dp=2 x ZeRO-2 and ZeRO-3 (fp32, bf16), pp=2 (again, and bf16), tp=2 x sp in bf16,
    cp=2 (Ulysses, and bf16), and ep=2 on
    a mixture of experts with sigmoid routing and the expert bias (fp32, bf16). The pp=2
    and ep=2 runs' step-2 checkpoints resume on one process (pp=2 -> 1, ep=2 -> 1) to the
    straight run's main and depth losses."""
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *MTP, *o))  # noqa: E731
    reference = check_rows(text, [
        ("dp2 zero2", ("--parallel.zero", "2")), ("dp2 zero2 bf16", ("--parallel.zero", "2", *BF16)),
        ("pp2", ("--parallel.pp", "2")), ("pp2 bf16", ("--parallel.pp", "2", *BF16)),
        ("tp2 sp bf16", (*TP_SP, *BF16)), ("cp2 ulysses", ("--parallel.cp", "2",
                                                           "--parallel.cp_mode", "ulysses")),
        ("cp2 bf16", ("--parallel.cp", "2", *BF16)), ("dp2 zero3", ("--parallel.zero", "3")),
        ("dp2 zero3 bf16", ("--parallel.zero", "3", *BF16))])
    moe = lambda name, *o: config.to_toml(tiny(tmp_path, f"moe-{name}", *MTP, *MOE, *o))  # noqa
    moe_reference = check_rows(moe, [("ep2", ("--parallel.ep", "2")),
                                     ("ep2 bf16", ("--parallel.ep", "2", *BF16))])
    for run, ref, make in (("pp2", reference, text), ("moe-ep2", moe_reference, moe)):
        step2 = tmp_path / run / "checkpoints" / "step_00000002"
        name = f"{run}-resumed"
        resumed = train_layout(0, 1, make(name, "--checkpoint.resume", str(step2)),
                               depth_losses)
        torch.testing.assert_close(torch.tensor(resumed["losses"]),
                                   torch.tensor(ref["losses"][2:]), rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(resumed["mtp"]), torch.tensor(ref["mtp"][2:]),
                                   rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow  # one 4-rank spawn of one row (~20 s loaded)
def test_mtp_parity_pp2_dp2_zero3(tmp_path):
    """ZeRO-3 under a pipeline: each unit (the last stage's head unit holds the modules)
    stays gathered through the step (without one: tests above, the head's event)."""
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *MTP, *o))  # noqa: E731
    check_rows(text, [("pp2 dp2 zero3", ("--parallel.pp", "2", "--parallel.zero", "3"))],
               world=4)


@pytest.mark.slow  # one 2-rank spawn of three rows (~15 s loaded)
def test_mtp_parity_schedules_tied(tmp_path):
    """A tied head on four blocks: the V (ZB-V: stage 0 holds the embedding, the head and
    the modules, the inputs read twice), interleaved and 1F1B (the last stage's one table
    serving the head and the modules)."""
    tied = ("--model.tie_embeddings", "true", "--model.n_layers", "4")
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *MTP, *tied, *o))  # noqa: E731
    v2 = ("--parallel.virtual_stages", "2")
    check_rows(text, [("zbv", ("--parallel.pp", "2", "--parallel.schedule", "zbv", *v2)),
                      ("interleaved", ("--parallel.pp", "2", "--parallel.schedule",
                                       "interleaved", *v2)),
                      ("pp2", ("--parallel.pp", "2"))])
