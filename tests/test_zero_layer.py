"""ZeRO-3 by broadcast (`parallel.zero_partition = layer`, parallel/zero/layer.py): each dp
rank owns whole units. Parity with one process (losses, eval loss, final weights; fp32 and
bf16) at dp = 2 (dp = 4 in the slow tier), resume from a flat checkpoint into the layer
partition and back, each rank's ledger bytes (broadcasts and reduces) and model states
against the planner's to the byte (plan/layer_partition.py), and the planner's
comparison of the two partitions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, make_mesh, tiny, train_layout,
                    train_layouts, worst_loss_deviation)
from shardtrain import config
from shardtrain.config import ConfigError, load
from shardtrain.plan.layer_partition import compare_partitions, layer_sent_bytes, zero3_units
from shardtrain.plan.layout import Layout, config_layout
from shardtrain.train.trainer import Trainer

LAYER = ("--parallel.zero", "3", "--parallel.zero_partition", "layer")
FLAT = ("--parallel.zero", "3")
BF16 = ("--train.precision", "bf16")
EVERY = ("--checkpoint.every", "2")
MODEL = ("--model.n_layers", "3")  # 5 units (embedding, 3 blocks, head) over 2 or 4 ranks


def _text(tmp, name: str, world: int, *overrides: str) -> str:
    # 2 micro-batches of 2 per rank and step (gradient accumulation)
    return config.to_toml(tiny(tmp, name, "--train.steps", "3", "--train.global_batch",
                               str(4 * world), *MODEL, *overrides))


def _step2(tmp, name: str) -> str:
    return str(tmp / name / "checkpoints" / "step_00000002")


def _ledger_step(rank: int, world: int, text: str) -> dict:
    """One step of a fresh layer-partition trainer: bytes sent by tag, model states."""
    cfg = config.loads(text)
    trainer = Trainer(cfg, make_mesh(cfg, rank, world), torch.device("cpu"))
    trainer.train_step()
    records = trainer.mesh.ledger.records
    return {"sent": {tag: sum(r.sent_bytes for r in records if r.tag == tag)
                     for tag in ("param", "grad")},
            "ops": sorted({(r.op, r.tag) for r in records if r.tag in ("param", "grad")}),
            "memory": trainer.memory_ledger(),
            "owned": [u.padded for u in trainer.parallel.update.units
                      if u.owner == dist.get_rank()]}


def _worker(rank: int, world: int, texts: list[str], ledger_text: str) -> tuple:
    return train_layouts(rank, world, texts), _ledger_step(rank, world, ledger_text)


def _check(tmp, world: int, per_rank: list, labels: list[str], refs: dict) -> None:
    for rank, (results, _) in enumerate(per_rank):
        for label, result in zip(labels, results):
            if label.endswith("bf16"):
                got = result["losses"] + [result["eval_loss"]]
                want = refs["bf16"]["losses"] + [refs["bf16"]["eval_loss"]]
                worst = worst_loss_deviation(want, got)
                print(f"{label} rank {rank}: worst loss deviation from one process {worst:.2e}")
                assert worst <= BF16_LOSS_RTOL[False], label
                continue
            ref = refs["fp32"]
            if "resumed" in label:  # steps 3 on, from the other partition's step 2
                ref = {**ref, "losses": ref["losses"][2:]}
            assert_parity(ref, result, f"{label} rank {rank}")
    # The ledger's bytes and states are the planner's, rank by rank, to the byte.
    cfg = tiny(tmp, "plan", *MODEL, *LAYER, "--train.global_batch", str(4 * world))
    units = zero3_units(cfg.model, config_layout(cfg, world))
    for rank, (_, step) in enumerate(per_rank):
        planned = layer_sent_bytes(units, world, rank, microbatches=2)
        print(f"rank {rank}: ledger {step['sent']}, planner {planned}, owns {step['owned']}")
        assert step["sent"] == planned and step["ops"] == [("broadcast", "param"),
                                                            ("reduce", "grad")]
        owned = sum(step["owned"])
        assert step["memory"]["params_bytes"] == 4 * owned  # the owner's units, whole
        assert step["memory"]["grads_bytes"] == 4 * owned
        assert step["memory"]["optimizer_bytes"] == 8 * owned


def _run(tmp, world: int) -> None:
    rows = {f"layer dp{world}": (*LAYER, *EVERY), f"layer dp{world} bf16": (*LAYER, *BF16)}
    if world == 2:  # a flat checkpoint resumed by the layer partition, and the reverse
        rows |= {"flat dp2": (*FLAT, *EVERY),
                 "layer resumed from flat": (*LAYER, "--checkpoint.resume",
                                             _step2(tmp, "w2-flat dp2")),
                 "flat resumed from layer": (*FLAT, "--checkpoint.resume",
                                             _step2(tmp, "w2-layer dp2"))}
    texts = [_text(tmp, f"w{world}-{label}", world, *o) for label, o in rows.items()]
    ledger = _text(tmp, f"w{world}-ledger", world, *LAYER)
    per_rank = run_distributed(_worker, world, texts, ledger)
    refs = {"fp32": train_layout(0, 1, _text(tmp, f"ref{world}", world)),
            "bf16": train_layout(0, 1, _text(tmp, f"ref{world}-bf16", world, *BF16))}
    _check(tmp, world, per_rank, list(rows), refs)


def test_layer_partition_dp2(tmp_path):
    _run(tmp_path, 2)


@pytest.mark.slow
def test_layer_partition_dp4(tmp_path):
    _run(tmp_path, 4)


def test_planner_compares_the_partitions():
    """Llama-3-8B over 8 dp ranks in fp32: the layer partition's busiest rank holds 17.4 GB
    of model state (whole units: 1.09x the flat partition's 16.1 GB, the lightest 14.0 GB)
    and sends 88.8 GB per step (2 (N - 1) S per unit it owns), flat 84.3 GB."""
    cmp = compare_partitions(load("llama3-8b").model, Layout(dp=8, zero=3, precision="fp32",
                                                         partition="layer"))
    flat, layer = cmp["flat"], cmp["layer"]
    print(cmp)
    assert layer["states_bytes"] > flat["states_bytes"] > layer["min_states_bytes"]
    assert layer["states_bytes"] < 1.3 * flat["states_bytes"]  # the greedy deal balances
    assert layer["sent_bytes"] > flat["sent_bytes"]


@pytest.mark.parametrize("overrides", [
    ["--parallel.zero", "2", "--parallel.zero_partition", "layer"],
    [*LAYER, "--parallel.tp", "2"],
    [*LAYER, "--parallel.offload", "cpu"],
])
def test_layer_partition_config_errors(tmp_path, overrides):
    with pytest.raises(ConfigError, match="parallel.zero_partition"):
        tiny(tmp_path, "bad", *overrides).validate(4)


def test_the_planner_proposes_layer_only_where_the_trainer_runs_it():
    """The search prices `partition=layer` beside `flat` for ZeRO-3 over dp alone; the
    planner refuses it elsewhere as the trainer does (tests/test_plan_runs.py checks every
    ranked layout against the trainer's validation)."""
    from shardtrain.plan.layout import PlanError, check, trainer_refusal
    from shardtrain.plan.search import enumerate_layouts

    cfg = load("llama3-8b").model
    layouts = list(enumerate_layouts(cfg, gpus=8, node_size=8, global_batch=64, seq_len=2048,
                                     precision="amp"))
    layer = [lay for lay in layouts if lay.partition == "layer"]
    assert layer and all(lay.zero == 3 and lay.dp == 8 and lay.offload == "none"
                         for lay in layer)
    assert trainer_refusal(layer[0], cfg, seq_len=2048) is None
    tp2 = Layout(dp=4, tp=2, zero=3, partition="layer", micro_batch=16)
    with pytest.raises(PlanError, match="partition=layer"):
        check(tp2, cfg, gpus=8, node_size=8, global_batch=64, seq_len=2048)
    assert "zero_partition" in trainer_refusal(tp2, cfg, seq_len=2048)
