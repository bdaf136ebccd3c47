"""Planner: replica groups (parallel.replicas, parallel.sync) and goodput under failures
(plan/replica_traffic.py, plan/goodput.py): the cross-replica bytes per ledger tag, the
inner group's terms following dp / replicas, the layouts refused, and the goodput
formulas' numbers (docs/planner.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

import pytest

from shardtrain.config import load
from shardtrain.cost import hardware
from shardtrain.plan.cli import main
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.goodput import replicas_goodput, restart_goodput, young_interval_s
from shardtrain.plan.layout import Layout, PlanError, check, config_layout, layout_overrides
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.partition import rank_params
from shardtrain.plan.replica_traffic import cross_replica_bytes
from shardtrain.plan.search import search
from shardtrain.plan.traffic import step_ops

TINY = load("tiny").model
HW = hardware.get("a100")
SEQ = 64


def _ops(**fields):
    return step_ops(TINY, Layout(**fields), HW, seq_len=SEQ)


def _params() -> float:
    return rank_params(TINY, Layout()).total


def test_every_step_all_reduces_the_gradient_shard_over_the_groups():
    # dp=8 in R=4 groups of 2 under ZeRO-2, fp32: each rank owns P / 2 gradients, ring
    # all-reduced over 4 groups: 2 (4-1)/4 x P/2 x 4 bytes, tagged rep:grad
    got = cross_replica_bytes(_ops(dp=8, zero=2, replicas=4, precision="fp32"))
    assert got == {"rep:grad": pytest.approx(2 * 3 / 4 * _params() / 2 * 4), "rep:weights": 0}
    # bf16 gradients on the wire: half; no ZeRO: the whole gradient
    bf16 = cross_replica_bytes(_ops(dp=8, zero=2, replicas=4, precision="bf16"))
    assert bf16["rep:grad"] == pytest.approx(got["rep:grad"] / 2)
    whole = cross_replica_bytes(_ops(dp=8, zero=0, replicas=4, precision="fp32"))
    assert whole["rep:grad"] == pytest.approx(2 * got["rep:grad"])
    assert cross_replica_bytes(_ops(dp=8, zero=2, precision="fp32")) == \
        {"rep:grad": 0, "rep:weights": 0}  # one group: nothing crosses


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_semi_synchronous_modes_send_the_weights_every_h_steps(sync):
    fp32 = dict(dp=4, zero=1, replicas=2, precision="fp32")
    every = cross_replica_bytes(_ops(**fp32))["rep:grad"]
    h8 = cross_replica_bytes(_ops(**fp32, sync=sync, sync_every=8))
    # fp32: weights and gradients both 4 bytes, so H=8 is exactly 1/8 of every_step's
    assert h8 == {"rep:grad": 0, "rep:weights": pytest.approx(every / 8)}
    # streaming fragments: a 1/F slice every H/F steps, the same per-step average
    frag = cross_replica_bytes(_ops(**fp32, sync=sync, sync_every=8, sync_fragments=4))
    assert frag["rep:weights"] == pytest.approx(h8["rep:weights"])
    # bf16 keeps fp32 masters: the weights cross in 4 bytes while the gradients took 2
    bf16 = dict(fp32, precision="bf16")
    grad2 = cross_replica_bytes(_ops(**bf16))["rep:grad"]
    weights = cross_replica_bytes(_ops(**bf16, sync=sync, sync_every=1))["rep:weights"]
    assert weights == pytest.approx(2 * grad2)
    # bf16-true has no master: the 16-bit parameters themselves
    true16 = cross_replica_bytes(_ops(**dict(fp32, precision="bf16-true"), sync=sync,
                                      sync_every=1))["rep:weights"]
    assert true16 == pytest.approx(weights / 2)


def test_inside_a_group_the_layout_is_that_of_its_dp():
    # HSDP: dp=8 in 2 groups shards and reduces as dp=4 does, memory included
    grouped = Layout(dp=8, zero=3, replicas=2, microbatches=2)
    alone = Layout(dp=4, zero=3, microbatches=2)
    inner = [op for op in step_ops(TINY, grouped, HW, seq_len=SEQ) if op.group == "dp"]
    assert inner == [op for op in step_ops(TINY, alone, HW, seq_len=SEQ) if op.group == "dp"]
    assert memory_per_gpu(TINY, grouped, seq_len=SEQ) == memory_per_gpu(TINY, alone, seq_len=SEQ)


def _check(lay: Layout) -> None:
    check(lay, TINY, gpus=lay.gpus, node_size=8, global_batch=lay.dp * lay.micro_batch
          * lay.microbatches, seq_len=SEQ)


@pytest.mark.parametrize("fields, words", [
    (dict(dp=4, replicas=3), "divide dp=4"),
    (dict(dp=4, replicas=2, ps_servers=1), "parameter server"),
    (dict(dp=4, replicas=2, sync_every=8), "local_sgd or diloco"),
    (dict(dp=4, replicas=2, sync="diloco", sync_every=8, sync_fragments=3), "dividing"),
    (dict(dp=4, replicas=2, sync="gossip"), "every_step, local_sgd, diloco"),
])
def test_layouts_the_trainer_does_not_run_are_refused(fields, words):
    with pytest.raises(PlanError, match=words):
        _check(Layout(**fields))


def test_config_round_trip_and_search_keeps_the_groups():
    cfg = load("tiny", ["--parallel.replicas", "2", "--parallel.sync", "diloco",
                        "--parallel.sync_every", "8"])
    lay = config_layout(cfg, 4)
    assert (lay.replicas, lay.sync, lay.sync_every, lay.nd) == (2, "diloco", 8, 2)
    again = load("tiny", layout_overrides(lay, seq_len=cfg.train.seq_len))  # and back
    assert config_layout(again, 4) == lay
    result = search(TINY, HW, gpus=8, global_batch=16, seq_len=SEQ, top=20,
                    replica={"replicas": 4})
    assert result.ranked and all(p.layout.replicas == 4 and p.layout.dp % 4 == 0
                                 for p in result.ranked)


def test_restart_goodput_numbers():
    # 1000 processes at MTBF 10000 h: 0.1 failures/h; T = 2 s, C = 100, S = 20 s
    g = restart_goodput(step_s=2, processes=1000, mtbf_hours=10_000, restart_s=300,
                        load_s=40, save_s=20, checkpoint_every=100)
    lost = 300 + 40 + (100 * 2 + 20) / 2  # 450 s
    fraction = 200 / 220 * (1 - 0.1 * lost / 3600)
    assert g.lost_per_failure_s == pytest.approx(lost)
    assert g.useful_steps_per_hour == pytest.approx(1800 * fraction)
    # Young: sqrt(2 x 20 s x 36000 s) = 1200 s = 600 steps
    assert young_interval_s(20, 36_000) == pytest.approx(1200)
    assert g.suggested_checkpoint_every == 600
    never = restart_goodput(step_s=2, processes=1000, mtbf_hours=10_000, restart_s=300,
                            load_s=40, save_s=20, checkpoint_every=0)
    assert never.useful_steps_per_hour == 0 and math.isinf(never.lost_per_failure_s)


def test_replicas_goodput_numbers():
    g = replicas_goodput(step_s=2, processes=1000, mtbf_hours=10_000, restart_s=300,
                         transfer_s=20, replicas=4)
    lost = 2 + (300 + 20) / 4  # the redone step, and a quarter of the batch for 320 s
    assert g.lost_per_failure_s == pytest.approx(lost)
    assert g.fraction == pytest.approx(1 - 0.1 * lost / 3600)
    # failures every 36 s on average: restart never finishes, the groups keep going
    kw = dict(step_s=2, processes=1000, mtbf_hours=10)
    assert restart_goodput(**kw, restart_s=300, load_s=40, save_s=20,
                           checkpoint_every=100).useful_steps_per_hour == 0
    assert replicas_goodput(**kw, restart_s=30, transfer_s=1, replicas=8).fraction > 0


def test_cli_reports_goodput_and_tagged_bytes():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--model", "tiny", "--gpus", "4", "--gpu", "a100", "--global-batch", "8",
                     "--seq", str(SEQ), "--layout", "dp=4,zero=1", "--replicas", "2",
                     "--sync", "diloco", "--sync-every", "8", "--mtbf-hours", "50",
                     "--checkpoint-every", "25", "--json"])
    doc = json.loads(out.getvalue())
    assert code == 0 and doc["layout"]["replicas"] == 2 and doc["layout"]["sync"] == "diloco"
    assert doc["comm"]["rep_by_tag"]["rep:weights"] > 0 == doc["comm"]["rep_by_tag"]["rep:grad"]
    good = doc["goodput"]
    assert good["inputs"]["checkpoint_every"] == 25 and good["inputs"]["processes"] == 4
    assert good["restart"]["failures_per_hour"] == pytest.approx(4 / 50)
    assert 0 < good["restart"]["fraction"] < good["replicas"]["fraction"] <= 1
    plan = evaluate(TINY, dataclasses.replace(Layout(dp=4, zero=1, microbatches=2),
                                              replicas=2, sync="diloco", sync_every=8),
                    HW, global_batch=8, seq_len=SEQ)
    assert good["inputs"]["step_s"] == pytest.approx(plan.time.step_s)
