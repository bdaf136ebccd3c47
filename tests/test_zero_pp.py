"""ZeRO-2 and ZeRO-3 composed with pipeline parallelism (zero/model.py, "With pipeline
parallelism" in docs/zero.md): pp = 2 x dp = 2 on 4 processes, fp32, reproduces the
single-process run (per-step losses, eval loss, final weights) under GPipe, 1F1B and the
interleaved schedule, with tied embeddings across the first and last stage, and resumed
from its own sharded checkpoint; the ledger's dp bytes per step equal the planner's
(one reduction per step, ZeRO-3 one gather per step) and the model-state bytes its memory
model. All rows run in one spawn."""

from __future__ import annotations

import random

import pytest
import torch

from dist import run_distributed
from parity import assert_parity, make_mesh, reference_runs, tiny, train_layouts
from shardtrain import config
from shardtrain.parallel.zero.gather import StepGatherer
from shardtrain.plan.memory import model_states
from shardtrain.plan.traffic import bytes_per_step, data_parallel_ops
from shardtrain.train.trainer import Trainer

STEPS = "3"
WORLD = 4  # pp 2 x dp 2
BASE = ("--model.n_layers", "4")
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")


def _pp(zero: int, schedule: str, m: int, *more: str) -> tuple[str, ...]:
    v = ("--parallel.virtual_stages", "2") if schedule == "interleaved" else ()
    return ("--parallel.pp", "2", "--parallel.zero", str(zero), "--parallel.schedule",
            schedule, "--parallel.microbatches", str(m), *v, *more)


# (label, model overrides -- the reference has them too --, layout overrides)
ROWS = [
    ("zero2 1f1b m2", (), _pp(2, "1f1b", 2, "--checkpoint.every", "2")),
    ("zero3 1f1b m2", (), _pp(3, "1f1b", 2, "--checkpoint.every", "2")),
    ("zero2 gpipe m4", (), _pp(2, "gpipe", 4)),
    ("zero3 gpipe m4", (), _pp(3, "gpipe", 4)),
    ("zero3 interleaved v2 m2", (), _pp(3, "interleaved", 2)),
    ("zero2 interleaved v2 m4", (), _pp(2, "interleaved", 4)),
    ("zero2 gpt2 tied 1f1b m2", GPT2, _pp(2, "1f1b", 2)),
    ("zero3 gpt2 tied 1f1b m2", GPT2, _pp(3, "1f1b", 2)),
    ("zero3 gpt2 tied interleaved v2 m2", GPT2, _pp(3, "interleaved", 2)),
    # the backward's recomputation finds the units still gathered
    ("zero3 1f1b m2 full recomputation", (),
     _pp(3, "1f1b", 2, "--train.activation_checkpointing", "full")),
    ("zero3 gpipe m4 offload cpu", (), _pp(3, "gpipe", 4, "--parallel.offload", "cpu")),
]
RESUMED = [0, 1]  # rows resumed in the same layout from their step-2 checkpoint


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """The module's directory, with a small corpus file (fingerprinting the default source
    costs seconds per process)."""
    path = tmp_path_factory.mktemp("zpp")
    words = [f"w{i}" for i in range(300)]
    rng = random.Random(0)
    (path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    return path


def _cfg(tmp, name: str, *overrides: str) -> config.Config:
    return tiny(tmp, name, "--train.steps", STEPS, "--data.source", str(tmp / "corpus.txt"),
                *BASE, *overrides)


def _step2(tmp, i: int) -> str:
    return str(tmp / f"row{i}" / "checkpoints" / "step_00000002")


def _ledger(rank: int, tmp) -> dict:
    """One training step of ZeRO-2 and ZeRO-3 at pp 2 x dp 2, m = 2: the dp bytes this rank
    sent (gradients, parameters) and its model-state bytes, with the unit sizes."""
    out = {}
    for zero, reduce in ((2, "fp32"), (3, "fp32"), (3, "bf16")):
        more = ("--train.precision", "bf16", "--train.grad_reduce_dtype", "bf16") \
            if reduce == "bf16" else ()
        # buckets of 10 KiB: each unit reduced alone (the rows above coalesce them all)
        cfg = _cfg(tmp, f"ledger-z{zero}-{reduce}-r{rank}", *_pp(zero, "1f1b", 2), *more,
                   "--comm.bucket_mb", "0.01")
        trainer = Trainer(cfg, make_mesh(cfg, rank, WORLD), torch.device("cpu"))
        record = trainer.train_step()
        z = trainer.parallel.update
        out[zero, reduce] = {
            "record": record, "padded": sum(u.padded for u in z.units), "units": len(z.units),
            # the units gathered in fp32 (ZeRO-3 under bf16 gathers the rest in bf16)
            "kept": sum(u.padded for u in z.units if u.flat.dtype == torch.float32),
            "sent": {tag: sum(r.sent_bytes for r in trainer.mesh.ledger.records
                              if r.tag == tag and r.group == "dp")
                     for tag in ("grad", "param")},
            "calls": {tag: sum(r.tag == tag and r.group == "dp"
                               for r in trainer.mesh.ledger.records)
                      for tag in ("grad", "param")},
            # between steps: no full gradient storage, ZeRO-3 no full parameter storage
            "held_grads": sum(u.grad_flat.untyped_storage().nbytes() for u in z.units),
            "held_params": sum(u.flat.untyped_storage().nbytes() for u in z.units),
            "step_gatherer": isinstance(z.gatherer, StepGatherer)}
    return out


def _worker(rank: int, world_size: int, texts: list[str], tmp) -> dict:
    return {"rows": train_layouts(rank, world_size, texts), "ledger": _ledger(rank, tmp)}


@pytest.fixture(scope="module")
def spawned(tmp):
    texts = [config.to_toml(_cfg(tmp, f"row{i}", *model, *layout))
             for i, (_, model, layout) in enumerate(ROWS)]
    texts += [config.to_toml(_cfg(tmp, f"row{i}", *ROWS[i][1], *ROWS[i][2],
                                  "--checkpoint.resume", _step2(tmp, i)))
              for i in RESUMED]
    return run_distributed(_worker, WORLD, texts, tmp, timeout_s=900)


def _reference(model: tuple, micro: int) -> tuple[str, ...]:
    return (*model, "--train.micro_batch", str(micro))


def test_zero_with_pipeline_matches_single_process(tmp, spawned):
    refs = reference_runs(lambda name, *o: config.to_toml(_cfg(tmp, name, *o)))
    for i, (label, model, layout) in enumerate(ROWS):
        # micro-batches of 2 (m = 2) or 1 (m = 4) from tiny's global batch 8 over dp 2:
        # the eval batches are micro-batch sized, so the reference uses the same size
        micro = 8 // (2 * int(layout[layout.index("--parallel.microbatches") + 1]))
        for rank, per_rank in enumerate(spawned):
            assert_parity(refs(_reference(model, micro)), per_rank["rows"][i],
                          f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in spawned[0]['rows'][i]['losses']]}")
    for k, i in enumerate(RESUMED):
        ref = refs(_reference(ROWS[i][1], 2))
        last = {**ref, "losses": ref["losses"][2:]}
        for rank, per_rank in enumerate(spawned):
            assert_parity(last, per_rank["rows"][len(ROWS) + k],
                          f"{ROWS[i][0]} resumed at step 2, rank {rank}")


def test_zero_with_pipeline_ledger_equals_planner(spawned):
    """dp bytes per step per rank: ZeRO-2 reduce-scatters once per step (not per
    micro-batch) and all-gathers after the step; ZeRO-3 all-gathers once per step and
    reduce-scatters once: the planner's `data_parallel_ops(pipelined=True)`. Model states
    (what stays between steps): the ZeRO formulas; the full copies held through the step are
    freed after it."""
    dp = 2
    for rank, r in enumerate(x["ledger"] for x in spawned):
        for (zero, reduce), got in r.items():
            # bf16 runs hold fp32 parameters (amp) and reduce gradients in bf16
            precision = "fp32" if reduce == "fp32" else "amp"
            plan = bytes_per_step(data_parallel_ops(
                params=got["padded"], size=dp, zero=zero, microbatches=2, precision=precision,
                layers=got["units"], pipelined=True, reduce_dtype=reduce,
                kept=got["kept"]))["dp"]
            sent = got["sent"]["grad"] + got["sent"]["param"]
            per_microbatch = bytes_per_step(data_parallel_ops(
                params=got["padded"], size=dp, zero=zero, microbatches=2, precision=precision,
                layers=got["units"], reduce_dtype=reduce, kept=got["kept"]))["dp"]
            print(f"rank {rank} zero{zero} reduce {reduce}: ledger {got['sent']} = {sent} B in "
                  f"{got['calls']} calls; planner {plan}; per micro-batch it would be "
                  f"{sum(per_microbatch.values()):.0f} B")
            assert sum(plan.values()) == pytest.approx(sent, abs=8), (rank, zero)
            assert sum(per_microbatch.values()) > sent  # m = 2: what the runtime avoids
            # one reduce-scatter and one all-gather per unit and step
            assert got["calls"] == {"grad": got["units"], "param": got["units"]}
            assert got["held_grads"] == 0
            assert got["held_params"] == (0 if zero == 3 else 4 * got["padded"])
            assert got["step_gatherer"] == (zero == 3)
            states = model_states(got["padded"], nd=dp, zero=zero, precision=precision)
            for key in ("params", "grads", "master", "optimizer"):
                assert got["record"][key + "_bytes"] == getattr(states, key), (rank, zero, key)
