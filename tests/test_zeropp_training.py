"""ZeRO++ wired into training (4 ranks in virtual nodes of 2, so qgZ takes its two hops):
hpZ exact, qwZ / qgZ close; and for each option alone, all three together, and qwZ + qgZ
at stage 2, the ledger's bytes of a step equal the planner's (plan/zeropp.py) to the byte,
and the ledger's model-state bytes the planner's exact count (plan/rank_states.py). One
spawn for every variant."""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout
from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.layout import config_layout
from shardtrain.plan.rank_states import rank0_states
from shardtrain.plan.traffic import step_ops
from shardtrain.plan.zeropp import zeropp_ops
from shardtrain.train.trainer import Trainer

STEPS = 3
WORLD, NODE = 4, 2
QW, HP, QG = (["--parallel.zero_quantized_weights", "true"], ["--parallel.zero_hpz", "true"],
              ["--parallel.zero_quantized_gradients", "true"])
VARIANTS = {  # label -> overrides on top of ZeRO-3 over 4 ranks in virtual nodes of 2
    "plain": [], "qwZ": QW, "hpZ": HP, "qgZ": QG, "all": QW + HP + QG,
    "zero2 qwZ+qgZ": ["--parallel.zero", "2"] + QW + QG,
    "all, 2 blocks per unit": QW + HP + QG + ["--parallel.zero_unit_blocks", "2"],
}
STATES = ("params", "grads", "master", "optimizer")
# ZeRO's collectives (zero/units.py, zero/zeropp.py); not the step's other "grad..." ones
ZERO_TAGS = ("param", "param:int8", "param:hpz", "grad", "grad:int8")


def _cfg(tmp, label, overrides):
    return tiny(tmp, label, "--train.steps", str(STEPS), "--train.global_batch", "8",
                "--train.micro_batch", "2", "--parallel.zero", "3", "--parallel.node_size",
                str(NODE), "--comm.algorithm", "ring", *overrides)


def _train(rank: int, world_size: int, texts: dict[str, str]) -> dict:
    """Worker: each variant's losses, final weights, the ledger of its training steps (and
    of the last one alone) and its model-state bytes."""
    out = {}
    for label, text in texts.items():
        cfg = config.loads(text)
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
        steps = [trainer.train_step() for _ in range(STEPS - 1)]
        first = len(trainer.mesh.ledger.records)
        steps.append(trainer.train_step())
        rows = [(r.op, r.group, r.tag, r.dtype, r.sent_bytes, r.sent_inter_node_bytes)
                for r in trainer.mesh.ledger.records if r.tag in ZERO_TAGS]
        last = [(r.group, r.sent_bytes, r.sent_inter_node_bytes)
                for r in trainer.mesh.ledger.records[first:] if r.tag in ZERO_TAGS]
        out[label] = {"losses": [r["loss"] for r in steps], "records": rows, "last": last,
                      "params_bytes": steps[-1]["params_bytes"],
                      "ledger": {k: trainer.memory_ledger()[f"{k}_bytes"] for k in STATES},
                      "weights": trainer.parallel.full_state_dict()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zeropp")
    cfgs = {label: _cfg(tmp, label, o) for label, o in VARIANTS.items()}
    per_rank = run_distributed(_train, WORLD, {k: config.to_toml(c) for k, c in cfgs.items()})
    return cfgs, per_rank, tmp


def _sent(records, tag: str) -> int:
    return sum(r[4] for r in records if r[2] == tag)


def test_zeropp_options_in_zero3_training(runs):
    cfgs, per_rank, tmp_path = runs
    reference = train_layout(0, 1, config.to_toml(tiny(
        tmp_path, "ref", "--train.steps", str(STEPS), "--train.global_batch", "8",
        "--train.micro_batch", "2")))
    crossing = 0
    cfg_model = cfgs["plain"].model
    assert not cfg_model.tie_embeddings
    for rank, runs in enumerate(per_rank):
        plain = runs["plain"]["records"]
        # hpZ quantizes nothing: it reproduces the single-process run exactly, and its
        # backward gathers (one per forward gather of the units but the embedding's, whose
        # backward reads only the token ids: 3 of tiny's 4 units) run inside the node.
        hpz = runs["hpZ"]
        reference_run = {**reference, "eval_loss": None}
        assert_parity(reference_run, {**hpz, "eval_loss": None}, f"hpZ rank {rank}")
        forward = [r for r in hpz["records"] if r[2] == "param"]
        backward = [r for r in hpz["records"] if r[2] == "param:hpz"]
        assert len(backward) == len(forward) * 3 // 4 > 0
        assert {r[1] for r in forward} == {"dp"} and {r[1] for r in backward} == {"dp_node"}
        assert all(r[5] == 0 for r in backward)
        crossing += sum(r[5] for r in forward)
        # Memory: the secondary shards are half of every unit gathered for backward (nodes
        # of 2), twice the quarter each rank keeps as its ZeRO-3 shard; not the table's.
        table = 4 * cfg_model.vocab_size * cfg_model.dim  # fp32 bytes of the token table
        assert hpz["params_bytes"] == 3 * runs["plain"]["params_bytes"] - table // 2
        # The dp-wide gather bytes: the forward ones stay (the backward ones left the dp
        # group), plain's backward ones less the table's.
        table_gather = STEPS * table * (WORLD - 1) // WORLD
        assert _sent(hpz["records"], "param") == (_sent(plain, "param") + table_gather) // 2
        # qwZ: int8 all-gathers, about a quarter of the fp32 bytes (plus scales, padding).
        qw = _sent(runs["qwZ"]["records"], "param:int8") / _sent(plain, "param")
        # qgZ: int8 all-to-alls (two hops: dp_node, then dp_inter) instead of the fp32
        # reduce-scatter; the inter-node hop only between ranks at the same place.
        qgz = runs["qgZ"]["records"]
        qg = _sent(qgz, "grad:int8") / _sent(plain, "grad")
        print(f"rank {rank}: qwZ param bytes {qw:.3f}x fp32, qgZ grad bytes {qg:.3f}x fp32")
        assert 0.25 < qw < 0.30 and 0.25 < qg < 0.30
        assert {r[1] for r in qgz if r[2] == "grad:int8"} == {"dp_node", "dp_inter"}
        for label in ("qwZ", "qgZ", "all"):
            losses = torch.tensor(runs[label]["losses"])
            exact = torch.tensor(runs["plain"]["losses"])
            assert not torch.equal(losses, exact)  # quantization changed something ...
            torch.testing.assert_close(losses, exact, rtol=1e-2, atol=0)  # ... a little
    assert crossing > 0


def test_ledger_equals_planner_for_each_zeropp_option(runs):
    """Per variant and rank, the last step's ZeRO bytes (tags param*, grad*, groups dp,
    dp_node, dp_inter) equal step_ops' dp ops on a cluster of nodes of 2, to the byte, and
    the model-state bytes equal rank0_states (hpZ's secondary shards, qwZ's block-aligned
    units and stage-2 master copy included)."""
    cfgs, per_rank, _ = runs
    hw = hardware.get("h100", {"gpus_per_node": str(NODE)})
    table = {}
    for label, cfg in cfgs.items():
        lay = config_layout(cfg, WORLD)
        bucket = cfg.comm.bucket_mb * 2**20
        ops = [op for op in step_ops(cfg.model, lay, hw, seq_len=cfg.train.seq_len,
                                     bucket_bytes=bucket) if op.group == "dp"]
        if label == "plain":  # step_ops' plain ZeRO spreads the unpadded parameters evenly
            # over the layers (within 8 bytes); zeropp_ops counts its units exactly
            estimate = sum(op.bytes_sent for op in ops)
            ops = zeropp_ops(cfg.model, lay, hw, bucket_bytes=bucket)
            assert estimate == pytest.approx(sum(op.bytes_sent for op in ops), abs=8)
        planned = sum(op.bytes_sent for op in ops)
        across = sum(op.bytes_sent for op in ops if op.what != "hpz"
                     and op.what != "int8 node")  # ops whose group spans the nodes
        states = rank0_states(cfg.model, lay, block=cfg.comm.quant_block, local=NODE)
        for rank, r in enumerate(per_rank):
            sent = sum(b for _, b, _ in r[label]["last"])
            wide = sum(b for g, b, _ in r[label]["last"] if g == "dp")
            wide += sum(b for g, b, _ in r[label]["last"] if g == "dp_inter")
            assert sent == pytest.approx(planned, abs=0.5), (label, rank, sent, planned)
            assert wide == pytest.approx(across, abs=0.5), (label, rank, wide, across)
            held = {k: int(getattr(states, k)) for k in STATES}
            assert r[label]["ledger"] == held, (label, rank, r[label]["ledger"], held)
        table[label] = (planned, across)
    base = table["plain"]
    for label, (planned, across) in table.items():
        print(f"{label:14s} bytes/step {planned:>9.0f} ({planned / base[0]:.3f}x plain ZeRO-3), "
              f"on node-spanning groups {across:>9.0f} ({across / base[1]:.3f}x)")
