"""One lifecycle row, run by every rank of the matrix's spawn (tests/test_lifecycle.py).

A row is a run's whole life, as a user drives it:

1. run A trains STEPS steps in the row's layout, checkpointing every HALF steps;
2. run B resumes A's step-HALF checkpoint in another layout (lifecycle_matrix.py
   `resume_layout`), trains to STEPS, prints a sample and exports a Hugging Face directory.

On the way every way of gathering the whole model onto one rank is made to raise (the
training path holds a rank's share only). Rank 0 then checks what must hold: every loss
finite; B's steps and final weights equal A's (resume equals no interruption, within the
precision's parity bounds); a sample printed; the export loads in `transformers` with the
logits of the model in B's final checkpoint. A mixture of experts has no Hugging Face
layout to export to: its row checks that `train.export_hf` is refused before any work.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from unittest import mock

import torch

from lifecycle_matrix import Row, label, overrides, resume_layout
from parity import BF16_LOSS_RTOL, LOSS_RTOL, WEIGHT_TOL, checkpoint_tensors, make_mesh, tiny
from shardtrain.config import Config, ConfigError
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel import strategy
from shardtrain.parallel.pipeline import state
from shardtrain.parallel.tensor import sharding
from shardtrain.train.ps_server import run_server
from shardtrain.train.trainer import Trainer, TrainResult

COMPILE = torch.compile
STEPS, HALF = 4, 2
SAMPLE_TOKENS = 6
TOKENS = torch.tensor([[100, 101, 32, 40, 41, 58, 10, 32, 32, 114]])  # "def (): ..." bytes
# Relative bounds of B against A: the same state at step HALF, each layout rounding its own
# partial sums. Under 16-bit compute, the harness's bf16 bounds (parity.py); the weights
# follow the loss: one or two steps of lr 1e-3 updates move by at most that much more.
WEIGHT_RTOL_16 = {False: 2e-3, True: 1e-2}
# bf16-true, fp16-true: no fp32 master absorbs B's other roundings, so a weight may sit two
# ulps of its format away, or 2 lr per step after the resume where Adam's normalised step
# flips on a near-zero 16-bit gradient (tests/test_true16_parity.py says why)
TRUE16_RTOL = {"bf16-true": 2 * 2.0**-7, "fp16-true": 2 * 2.0**-10}
TRUE16_ATOL = 2 * 1e-3 * (STEPS - HALF)  # the tiny preset's lr 1e-3


def _gathered(*args, **kwargs):
    raise AssertionError("the whole model was gathered onto one rank on the training path")


GATHERS = [(strategy.Strategy, "full_state_dict"), (state.StageShards, "full_state_dict"),
           (sharding.TensorShards, "full_state_dict"), (state, "all_gather_objects")]


def configs(tmp: Path, row: Row) -> tuple:
    """Runs A and B of `row` under `tmp` (B's export refused for a mixture of experts)."""
    base = ("--train.steps", str(STEPS), "--checkpoint.every", str(HALF),
            "--train.eval_batches", "1")
    a = tiny(tmp, "a", *base, *overrides(row))
    resumed = (*base, *overrides(resume_layout(row)), "--checkpoint.resume",
               str(tmp / "a" / "checkpoints" / f"step_{HALF:08d}"),
               "--train.sample_tokens", str(SAMPLE_TOKENS))
    export = ("--train.export_hf", str(tmp / "hf"))
    try:
        b = tiny(tmp, "b", *resumed, *export)
        b.validate(2)
        refused = None
    except ConfigError as e:
        if row["model"] != "moe":
            raise
        b, refused = tiny(tmp, "b", *resumed), str(e)
    return a, b, refused


def run_row(rank: int, world_size: int, tmp: Path, row: Row, backend: str) -> dict | None:
    """Runs A and B on this rank; rank 0 returns what `check_row` reads. `backend`:
    torch.compile's for compiled rows (parallel/compile.py)."""
    a, b, refused = configs(tmp, row)
    # Each run's model afresh (below): the rows share the blocks' code, whose graphs would
    # otherwise pile up to dynamo's recompile limit (8), past which it runs them eagerly.
    with ExitStack() as stack:
        for owner, name in GATHERS:
            stack.enter_context(mock.patch.object(owner, name, _gathered))
        stack.enter_context(mock.patch.object(torch, "compile", partial(COMPILE, backend=backend)))
        results = []
        for cfg in (a, b):  # as two launches would: B compiles its own graphs
            torch._dynamo.reset()
            results.append(_run(cfg, make_mesh(cfg, rank, world_size)))
    if rank != 0:
        return None
    return {"a": results[0].losses, "b": results[1].losses, "sample": results[1].sample,
            "refused": refused, "tp": "tp" in row["layout"] + resume_layout(row)["layout"]}


def _run(cfg: Config, mesh: ParallelMesh) -> TrainResult | None:
    """The trainer on a worker, the server loop on a parameter server's rank."""
    if not mesh.member:
        run_server(cfg, mesh)
        return None
    return Trainer(cfg, mesh, torch.device("cpu")).run()


def check_row(tmp: Path, row: Row, got: dict) -> None:
    """What must hold after a row's runs (rank 0's results)."""
    name = label(row)
    assert all(map(math.isfinite, got["a"] + got["b"])), f"{name}: a loss is not finite: {got}"
    assert len(got["a"]) == STEPS and len(got["b"]) == STEPS - HALF, f"{name}: {got}"
    # fp8's e4m3 roundings turn a layout's different summation order into a different
    # rounded operand now and then (docs/precision.md, "FP8"): the 16-bit bounds, in fp32 too
    low = row["precision"] != "fp32" or row.get("fp8", "none") != "none"
    loss_rtol = BF16_LOSS_RTOL[got["tp"]] if low else LOSS_RTOL
    weight_rtol = WEIGHT_RTOL_16[got["tp"]] if low else WEIGHT_TOL
    weight_atol = weight_rtol
    if row["precision"] in TRUE16_RTOL:
        weight_rtol, weight_atol = max(TRUE16_RTOL[row["precision"]], weight_rtol), TRUE16_ATOL
    if low and row.get("optim") == "rmsprop":  # its first steps move up to lr / sqrt(1 -
        weight_rtol *= 10  # alpha) = 10 lr (no bias correction): 16-bit noise 10x Adam's,
        weight_atol *= 10  # and the losses' (zero3-layer -> zero2 under fp8, qwen3: 3.6e-3
        loss_rtol *= 10  # with rmsprop, 4.5e-5 with adamw, 0 without fp8)
    torch.testing.assert_close(torch.tensor(got["b"]), torch.tensor(got["a"][HALF:]),
                               rtol=loss_rtol, atol=0,
                               msg=lambda m: f"{name}: resumed losses differ\n{m}")
    final = f"checkpoints/step_{STEPS:08d}"
    weights_b = checkpoint_tensors(tmp / "b" / final)
    for key, w in checkpoint_tensors(tmp / "a" / final).items():
        torch.testing.assert_close(weights_b[key], w, rtol=weight_rtol, atol=weight_atol,
                                   msg=lambda m: f"{name}: final {key} differs\n{m}")
    assert got["sample"] and got["sample"].startswith("def "), f"{name}: no sample: {got}"
    if row["model"] == "moe":
        assert "train.export_hf" in got["refused"], f"{name}: {got['refused']}"
        return
    _check_export(tmp, name, final)


def _check_export(tmp: Path, name: str, final: str) -> None:
    import transformers

    from shardtrain.train.finetune.export import load_checkpoint_model

    ours, _ = load_checkpoint_model(tmp / "b" / final)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
    # The byte tokenizer's ids (EOS 0xFF, no BOS), not the family's defaults in transformers.
    assert (back.config.bos_token_id, back.config.eos_token_id) == (None, 255), name
    with torch.no_grad():
        want, got = ours.eval()(TOKENS), back(TOKENS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4,
                               msg=lambda m: f"{name}: exported logits differ\n{m}")


def run_rows(rank: int, world_size: int, tmp: str, rows: list[Row], backend: str
             ) -> list[dict | None]:
    """Worker: every row in order, each under its own directory."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(run_row(rank, world_size, Path(tmp) / f"row{i:02d}", row, backend))
        except Exception as e:
            raise RuntimeError(f"lifecycle row {i} ({label(row)}) failed on rank {rank}") from e
    return out
