"""ZeRO composed with expert parallelism (zero/model.py, docs/zero.md "With expert
parallelism"): the experts' flat units are sharded over the expert-data-parallel group
(edp), the rest over dp. Parity with the single-process MoE run (fp32, dropless, balance and
z losses on: per-step losses, eval loss, final weights and the logged grad norms, which a
mis-scaled expert gradient or a miscounted norm would move) for ep=2 with ZeRO-3 on 2
processes; on 4, ep=2 x dp=2 with ZeRO-1, ZeRO-2 (cpu offload), ZeRO-3 (prefetch 2, 8-bit
AdamW, hpZ), ZeRO-1 resumed in the same layout from its own step-2 checkpoint,
ep=2 x pp=2 and ep=2 x tp=2 (sp) with ZeRO-3, ep=2 x cp=2 with ZeRO-2 (the dense units over
dp x cp); qwZ + qgZ stay within 1%. Each rank's units hold the experts
apart, sharded over edp, and the ledger shows their traffic there. One spawn per world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from parity import assert_parity, tiny, train_layout, train_layouts
from shardtrain import config

# The MoE run of tests/test_ep.py, 4 steps (a resumed row picks up after step 2).
MOE = ("--model.n_experts", "4", "--model.moe_aux_loss_coef", "0.1",
       "--model.moe_z_loss_coef", "0.01", "--train.steps", "4", "--train.eval_every", "4")
# Micro-batches of 2: global batch 8 over dp 2, 16 over dp 4: 2 accumulation micro-steps.
B8, B16 = ("--train.global_batch", "8"), ("--train.global_batch", "16")
EP2 = ("--parallel.ep", "2")


def _zero(stage: int, *more: str) -> tuple[str, ...]:
    return (*EP2, "--parallel.zero", str(stage), *more)


# (label, reference overrides, layout overrides, edp size)
ROWS = {
    2: [("ep2 zero3 (edp 1)", B8, _zero(3), 1)],
    4: [("ep2 x dp2 zero1", B16, _zero(1, "--checkpoint.every", "2"), 2),
        ("ep2 x dp2 zero2 offload cpu", B16, _zero(2, "--parallel.offload", "cpu"), 2),
        ("ep2 x dp2 zero3, prefetch 2", B16, _zero(3, "--parallel.zero_prefetch", "2"), 2),
        ("ep2 x dp2 zero3 adamw8bit", (*B16, "--optim.name", "adamw8bit"), _zero(3), 2),
        # hpZ's node-local copies are exact: nodes of 2 hold 2 dp ranks, 1 edp rank each
        ("ep2 x dp2 zero3 hpZ", B16, _zero(3, "--parallel.zero_hpz", "true",
                                           "--parallel.node_size", "2"), 2),
        ("ep2 x pp2 zero3 1f1b", B8, _zero(3, "--parallel.pp", "2"), 1),
        # experts whole over tp, their gradient parts summed over tp under sp
        ("ep2 x tp2 sp zero3", B8, _zero(3, "--parallel.tp", "2", "--parallel.sp", "true"), 1),
        # ZeRO over dp x cp for the dense units, edp = dp x cp / ep for the experts
        ("ep2 x cp2 zero2", B8, _zero(2, "--parallel.cp", "2"), 2)],
}
QUANTIZED = _zero(3, "--parallel.zero_quantized_weights", "true",
                  "--parallel.zero_quantized_gradients", "true")  # qwZ + qgZ: close, not equal
RESUMED = 0  # the 4-process row resumed from its step-2 checkpoint


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("epzero")


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, *MOE, *overrides))


def _norms(trainer) -> dict:
    """The logged per-step grad norms (rank 0 writes metrics.jsonl; None elsewhere)."""
    path = Path(trainer.cfg.train.run_dir) / "metrics.jsonl"
    return {"grad_norms": [json.loads(line)["grad_norm"] for line in
                           path.read_text().splitlines()] if path.exists() else None}


@pytest.fixture(scope="module")
def references(tmp):
    """Single-process runs (with their grad norms) by reference overrides, each trained once."""
    cache: dict[tuple, dict] = {}

    def get(ref: tuple) -> dict:
        if ref not in cache:
            cache[ref] = train_layout(0, 1, _text(tmp, f"ref-{len(cache)}", *ref), _norms)
        return cache[ref]

    return get


def _records(trainer) -> dict:
    """The grad norms, which groups the ZeRO traffic used, and this rank's units: their
    groups and shards."""
    z, mesh = trainer.parallel.update, trainer.mesh
    edp = mesh.comm("edp")
    experts = [u for u in z.units if u.comm.comm is edp]
    dense = [u for u in z.units if u.comm.comm is not edp]
    return {**_norms(trainer),
            "zero_ops": sorted({(r.op, r.group) for r in mesh.ledger.records
                                if r.tag.split(":")[0] in ("grad", "param")}),
            "replica": mesh.replica_dim,
            "units": [(u.names[0], u.comm.comm.name, u.padded, u.shard_numel) for u in z.units],
            "expert_names": sorted(n for u in experts for n in u.names),
            "dense_shard": sum(u.shard_numel * mesh.comm(mesh.replica_dim).size for u in dense),
            "expert_shard": sum(u.shard_numel * edp.size for u in experts),
            "padded": (sum(u.padded for u in dense), sum(u.padded for u in experts))}


def _check_groups(run: dict, label: str, *, edp: int) -> None:
    """Expert units hold exactly the experts, each after its block's dense unit, sharded
    over edp; their gradients went over edp, the rest over the replica group."""
    names = [n for n, *_ in run["units"]]
    assert run["expert_names"] and all(".experts." in n for n in run["expert_names"]), label
    for i, (name, group, padded, shard) in enumerate(run["units"]):
        if ".experts." in name:
            block = name.split(".experts.")[0].rsplit(".mlp", 1)[0]
            assert names[i - 1].startswith(block + "."), (label, names)
            assert group == "edp" and shard * edp == padded, (label, name)
        else:
            assert group == run["replica"], (label, name)
    assert run["dense_shard"] == run["padded"][0] and run["expert_shard"] == run["padded"][1]
    ops = run["zero_ops"]
    assert ("reduce_scatter", run["replica"]) in ops, (label, ops)
    if edp > 1:  # a group of one moves nothing and records nothing
        assert ("reduce_scatter", "edp") in ops and ("all_gather", "edp") in ops, (label, ops)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_with_expert_parallelism_matches_single_process(tmp, references, world):
    rows = ROWS[world]
    texts = [_text(tmp, f"w{world}-{i}", *ref, *layout)
             for i, (_, ref, layout, _) in enumerate(rows)]
    if world == 4:  # ZeRO-1 resumed in the same layout from its own step-2 checkpoint; ZeRO++
        step2 = tmp / f"w{world}-{RESUMED}" / "checkpoints" / "step_00000002"
        texts.append(_text(tmp, "w4-resumed", *rows[RESUMED][1], *_zero(1),
                           "--checkpoint.resume", str(step2)))
        texts.append(_text(tmp, "w4-quantized", *B16, *QUANTIZED))
    per_rank = run_distributed(train_layouts, world, texts, _records)
    for i, (label, ref, _, edp) in enumerate(rows):
        reference = references(ref)
        for rank, results in enumerate(per_rank):
            run = results[i]
            assert_parity(reference, run, f"{label} rank {rank}")
            _check_groups(run, f"{label} rank {rank}", edp=edp)
            if run["grad_norms"] is not None:  # rank 0: Adam hides a mis-scaled gradient
                torch.testing.assert_close(torch.tensor(run["grad_norms"]),
                                           torch.tensor(reference["grad_norms"]), rtol=1e-5,
                                           atol=0, msg=f"{label}: grad norms differ")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
    if world == 4:
        reference = references(rows[RESUMED][1])
        resumed = {**reference, "losses": reference["losses"][2:]}
        for rank, results in enumerate(per_rank):
            assert_parity(resumed, results[-2], f"ep2 x dp2 zero1 resumed at step 2, rank {rank}")
            quantized = results[-1]
            assert {("all_to_all", "edp"), ("all_gather", "edp")} <= set(quantized["zero_ops"])
            losses, exact = torch.tensor(quantized["losses"]), torch.tensor(reference["losses"])
            assert not torch.equal(losses, exact)  # int8 weights and gradients changed them ...
            torch.testing.assert_close(losses, exact, rtol=1e-2, atol=0)  # ... a little
        print(f"ep2 x dp2 zero3 qwZ + qgZ: losses {[round(x, 5) for x in per_rank[0][-1]['losses']]}")
