"""The precision policy (parallel/precision.py): every layout computes the single process's
numbers in bf16 as in fp32; fp16's loss scaler skips an overflowing step on every rank and
changes nothing in it; ledger bytes equal the planner's under bf16 with both reduce dtypes.
(The scaler's rules, its checkpoint and the config checks: tests/test_precision_rules.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from dist import run_distributed
from parity import (BF16_LOSS_RTOL as BOUND, make_mesh, tiny, train_layout, train_layouts,
                    worst_loss_deviation)
from shardtrain import config
from shardtrain.cost.units import backward_reads_params
from shardtrain.plan.memory import model_states
from shardtrain.plan.traffic import bytes_per_step, data_parallel_ops
from shardtrain.train.trainer import Trainer

STEPS = "8"
B8 = ("--train.global_batch", "8", "--train.micro_batch", "2")
B16 = ("--train.global_batch", "16", "--train.micro_batch", "2")
# BOUND (parity.py's BF16_LOSS_RTOL): the worst relative per-step loss deviation allowed
# from the single-process run of the same precision, without tp and with it.
LAYOUTS = {  # world size: (label, reference batch, overrides)
    2: [("dp2 accumulate", B8, []),
        ("zero1 dp2", B8, ["--parallel.zero", "1"]),
        ("zero2 dp2", B8, ["--parallel.zero", "2"]),
        ("zero3 dp2", B8, ["--parallel.zero", "3"]),
        ("pp2 1f1b", B8, ["--parallel.pp", "2", "--parallel.schedule", "1f1b"]),
        ("tp2", B8, ["--parallel.tp", "2"]),
        ("tp2 sp", B8, ["--parallel.tp", "2", "--parallel.sp", "true"])],
    4: [("dp4 accumulate", B16, []),
        ("pp2 x dp2 x zero3", B8, ["--parallel.pp", "2", "--parallel.zero", "3"])],
    # two ranks, slow tier: seed 002's one-state optimizers, ZeRO-3's unit size and its
    # gradient offload (their fp32 rows are in the README's command: test_zero*.py)
    "2 more": [
        ("zero2 dp2 rmsprop", (*B8, "--optim.name", "rmsprop"), ["--parallel.zero", "2"]),
        ("zero2 dp2 adagrad", (*B8, "--optim.name", "adagrad"), ["--parallel.zero", "2"]),
        ("zero3 dp2 2 blocks per unit", B8, ["--parallel.zero", "3",
                                             "--parallel.zero_unit_blocks", "2"]),
        ("zero3 dp2 cpu offload", B8, ["--parallel.zero", "3", "--parallel.offload", "cpu"])],
}
WORLD = {2: 2, 4: 4, "2 more": 2}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("precision")


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *overrides))


def _parity_texts(tmp, world_size: int | str) -> list[str]:
    return [_text(tmp, f"w{world_size}-{i}-{prec}".replace(" ", "-"), *ref, *o,
                  "--train.precision", prec)
            for i, (_, ref, o) in enumerate(LAYOUTS[world_size]) for prec in ("bf16", "fp32")]


def _world2(rank: int, world_size: int, tmp, parity: list[str], inject: list) -> dict:
    """Every two-rank check in one spawn (spawning is the slow part)."""
    return {"parity": train_layouts(rank, world_size, parity),
            "inject": _inject(rank, world_size, inject), "ledger": _one_step(rank, world_size, tmp)}


@pytest.fixture(scope="module")
def world2(tmp) -> list[dict]:
    return run_distributed(_world2, 2, tmp, _parity_texts(tmp, 2), _inject_runs(tmp),
                           timeout_s=600)


@pytest.fixture(scope="module")
def refs() -> dict:
    return {}  # (batch overrides, precision) -> the single-process run, filled once


@pytest.mark.parametrize("world_size", [2, 4, pytest.param("2 more", marks=pytest.mark.slow)])
def test_bf16_layouts_match_one_process(tmp, world2, refs, world_size):
    layouts = LAYOUTS[world_size]
    if world_size == 2:
        per_rank = [r["parity"] for r in world2]
    else:
        per_rank = run_distributed(train_layouts, WORLD[world_size],
                                   _parity_texts(tmp, world_size), timeout_s=600)
    for ref in dict.fromkeys(ref for _, ref, _ in layouts):
        for prec in ("bf16", "fp32"):
            if (ref, prec) not in refs:
                refs[ref, prec] = train_layout(0, 1, _text(tmp, f"ref-{len(refs)}-{prec}",
                                                           *ref, "--train.precision", prec))
    print()
    for i, (label, ref, overrides) in enumerate(layouts):
        worst = {prec: max(worst_loss_deviation(refs[ref, prec]["losses"], ranks[2 * i + j]["losses"])
                           for ranks in per_rank)
                 for j, prec in enumerate(("bf16", "fp32"))}
        bound = BOUND["--parallel.tp" in overrides]
        print(f"{label:>20}: worst relative loss deviation bf16 {worst['bf16']:.2e} "
              f"(bound {bound:.0e}), fp32 {worst['fp32']:.2e}")
        assert worst["bf16"] <= bound, label
        assert worst["fp32"] <= 1e-5, label  # the fp32 parity bound
    # bf16 computes: close to fp32, not equal to it.
    bf16, fp32 = refs[layouts[0][1], "bf16"]["losses"], refs[layouts[0][1], "fp32"]["losses"]
    assert bf16 != fp32 and worst_loss_deviation(fp32, bf16) < 1e-2


# ---------------------------------------------------------------- fp16 and the loss scaler

K = 3  # the step (1-based) whose gradient gets an inf


def _state(trainer: Trainer) -> tuple[dict, dict]:
    """(full weights, this rank's optimizer state as checkpoint pieces): collectives, on
    every rank."""
    pieces, extra = trainer.parallel.state_pieces()
    optim = {(p.region.key, p.region.start): p.fetch().clone() for p in pieces
             if p.region.key.startswith("optim/")}
    return trainer.parallel.full_state_dict(), {**optim, "steps": extra["optim_steps"]}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _inject(rank: int, world_size: int, runs: list[tuple[str, bool]]) -> list[dict]:
    """Each config trained; with inject, on rank 0 only, one element of the first
    parameter's gradient becomes inf in step K's backward (before any reduction)."""
    out = []
    for text, inject in runs:
        cfg = config.loads(text)
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
        if rank == 0 and inject:
            first = next(trainer.parallel.module.parameters())

            def poison(grad, trainer=trainer):
                if trainer.step == K - 1:
                    grad = grad.clone()
                    grad.view(-1)[0] = float("inf")
                return grad

            first.register_hook(poison)
        records, unchanged = [], None
        while trainer.step < cfg.train.steps:
            before = _state(trainer) if trainer.step == K - 1 else None
            records.append(trainer.train_step())
            if before is not None:
                unchanged = _equal(before, _state(trainer))
        out.append({"skipped": [r["skipped"] for r in records],
                    "scale": [r["loss_scale"] for r in records],
                    "losses": [r["loss"] for r in records], "unchanged": unchanged,
                    "weights": trainer.parallel.full_state_dict()})
    return out


def _distance(a: dict, b: dict) -> float:
    """The L2 norm of the difference of two full state dicts."""
    return math.sqrt(sum((a[n] - b[n]).double().square().sum().item() for n in a))


INJECT_LAYOUTS = {"dp2": [], "pp2": ["--parallel.pp", "2"]}
INJECTED = (("fp16", True), ("fp32", True), ("fp32", False))  # per layout


def _inject_runs(tmp) -> list[tuple[str, bool]]:
    return [(_text(tmp, f"inf-{name}-{prec}-{inject}", *B8, *o, "--train.steps", "6",
                   "--train.precision", prec, "--loss_scale.hysteresis", "1"), inject)
            for name, o in INJECT_LAYOUTS.items() for prec, inject in INJECTED]


def test_fp16_overflow_skips_the_step_on_every_rank(world2):
    per_rank = [r["inject"] for r in world2]
    for i, name in enumerate(INJECT_LAYOUTS):
        for rank, results in enumerate(per_rank):
            fp16, fp32, applied = results[3 * i:3 * i + 3]
            label = f"{name} rank {rank}"
            expected = [step == K for step in range(1, 7)]
            assert fp16["skipped"] == expected == fp32["skipped"], label
            assert applied["skipped"] == [False] * 6, label
            # Nothing of the skipped step reached the weights or the optimizer state.
            assert fp16["unchanged"] and fp32["unchanged"], label
            # The step's backward ran at 2^16; the overflow halved it for the next step
            # (hysteresis 1 here: the default 2 tolerates one overflow first).
            assert fp16["scale"] == [2.0**16] * K + [2.0**15] * (6 - K), label
            assert fp32["scale"] == [1.0] * 6, label
            # Against the fp32 control that skips the same step, the fp16 weights differ by
            # fp16's rounding of the activations only: far less than step K's update would
            # have moved them (the control against the run that applied it).
            noise = _distance(fp16["weights"], fp32["weights"])
            signal = _distance(applied["weights"], fp32["weights"])
            print(f"{label}: skipped {fp16['skipped']}, scale {fp16['scale']}; weights "
                  f"|fp16 - fp32 control| {noise:.2e}, |control - step {K} applied| "
                  f"{signal:.2e}")
            assert noise < 0.1 * signal, label
            assert all(math.isfinite(x) for x in fp16["losses"]), label


# ---------------------------------------------------------------- ledger bytes = planner bytes


def _one_step(rank: int, world_size: int, tmp) -> dict:
    out = {}
    for zero in (0, 1, 2, 3):
        for reduce in ("fp32", "bf16"):
            cfg = tiny(tmp, f"ledger-z{zero}-{reduce}-r{rank}", "--train.global_batch", "8",
                       "--train.micro_batch", "2", "--comm.bucket_mb", "0.1",
                       "--train.precision", "bf16", "--train.grad_reduce_dtype", reduce,
                       "--parallel.zero", str(zero))
            trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
            record = trainer.train_step()
            update = trainer.parallel.update
            padded = sum(u.padded for u in update.units) if zero else \
                sum(b.buffer.numel() for b in update.reducer.buckets)
            sent = {tag: sum(r.sent_bytes for r in trainer.mesh.ledger.records if r.tag == tag)
                    for tag in ("grad", "param")}
            # the units gathered in fp32 (ZeRO-3 gathers the rest in bf16: zero/units.py)
            kept = sum(u.padded for u in update.units if u.flat.dtype == torch.float32) \
                if zero else 0
            # the embedding's table, gathered for forward only (cost/units.py)
            lookup = sum(u.padded for u in update.units if not backward_reads_params(u.key)) \
                if zero else 0
            out[zero, reduce] = {"sent": sent, "padded": padded, "record": record,
                                 "units": len(update.units) if zero else 0, "kept": kept,
                                 "lookup": lookup}
    return out


def test_ledger_bytes_equal_planner_traffic_in_bf16(world2):
    world, m = 2, 2  # micro-batches per rank per step
    for rank, r in enumerate(x["ledger"] for x in world2):
        for (zero, reduce), got in r.items():
            plan = bytes_per_step(data_parallel_ops(
                params=got["padded"], size=world, zero=zero, microbatches=m, precision="amp",
                reduce_dtype=reduce, layers=max(got["units"], 1), kept=got["kept"],
                lookup=got["lookup"]))["dp"]
            sent = got["sent"]["grad"] + got["sent"]["param"]
            print(f"rank {rank} zero{zero} reduce {reduce}: ledger {got['sent']} = "
                  f"{sent} B, planner {plan}")
            assert sum(plan.values()) == pytest.approx(sent, abs=8), (zero, reduce)
        # bf16 halves the gradient bytes; the parameters' (the same dtypes) do not change.
        for zero in (0, 1, 2, 3):
            fp32, bf16 = r[zero, "fp32"]["sent"], r[zero, "bf16"]["sent"]
            assert 2 * bf16["grad"] == fp32["grad"] and bf16["param"] == fp32["param"]
            rec = r[zero, "bf16"]["record"]
            assert rec["skipped"] is False and rec["loss_scale"] == 1.0
            if zero:  # model states: the ZeRO formulas with the runtime's amp bytes (4+4+0+8)
                states = model_states(r[zero, "bf16"]["padded"], nd=world, zero=zero,
                                      precision="amp")
                for key in ("params", "grads", "master", "optimizer"):
                    assert rec[key + "_bytes"] == getattr(states, key), (zero, key)
