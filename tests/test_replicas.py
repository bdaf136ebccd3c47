"""Replica groups under fault.mode=restart (parallel/replica/): R groups in one world equal
plain data parallelism of the same global batch (every_step, and local_sgd / diloco at
H = 1 with a linear optimizer); DiLoCo at H = 8 moves 1/8 of every_step's cross-replica
bytes; DiLoCo's outer state survives a checkpoint; the config refusals."""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, tiny, train_layout, train_layouts,
                    worst_loss_deviation)
from shardtrain import config
from shardtrain.ckpt.regions import Region
from shardtrain.config import ConfigError
from shardtrain.config.replicas import total_world
from shardtrain.cost import hardware
from shardtrain.mesh import MeshShape, shape_for
from shardtrain.parallel.replica.sync import ReplicaSync, fragments
from shardtrain.parallel.replica.transfer import PiecesReader, pieces_state
from shardtrain.parallel.replica.view import ReplicaView
from shardtrain.plan.layout import config_layout
from shardtrain.plan.replica_traffic import cross_replica_bytes
from shardtrain.plan.traffic import step_ops

STEPS = "4"
R2 = ("--parallel.replicas", "2")
# local_sgd / diloco at H = 1 equal plain dp only where the optimizer's update is linear in
# the gradient (the mean of the groups' updates is then the update of the mean gradient):
# SGD with momentum (each group's buffer stays the mean's, by induction), no clipping
# (a per-group clip would scale each group's own norm).
SGD = ("--optim.name", "sgd", "--optim.momentum", "0.9", "--optim.grad_clip", "0",
       "--train.lr", "0.05")
H1 = ("--parallel.sync_every", "1")
# DiLoCo with a checkpoint on a synchronised step and no inner optimizer state.
DILOCO2 = ("--parallel.sync", "diloco", "--parallel.sync_every", "2", "--optim.name", "sgd",
           "--optim.momentum", "0")
ADAM4 = ("--parallel.sync", "diloco", "--parallel.sync_every", "4")
DILOCO_PLAIN = ("--parallel.sync", "diloco", *H1, "--parallel.outer_lr", "1",
                "--parallel.outer_momentum", "0")


def _text(tmp, name: str, *overrides: str, steps: str = STEPS) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", steps, "--checkpoint.every", "0",
                               *overrides))


def _rep_state(trainer) -> dict:
    """This rank's bytes sent across groups, by ledger tag (rep:grad, rep:weights, ...),
    and DiLoCo's outer copy and momentum (empty for the other modes)."""
    out: dict[str, int] = {}
    for r in trainer.mesh.ledger.records:
        if r.tag.startswith("rep:"):
            out[r.tag] = out.get(r.tag, 0) + r.sent_bytes
    sync = trainer.parallel.replica
    return {"rep_bytes": out, "outer": [t.clone() for t in sync.outer + sync.buf]
            if sync is not None else []}


def _step(tmp, name: str, step: int) -> str:
    return str(tmp / name / "checkpoints" / f"step_{step:08d}")


def test_shape_puts_the_groups_outermost():
    shape = MeshShape(rep=2, dp=2, tp=2)
    assert shape.world_size == 8 and shape.group_size == 4
    assert shape.groups("rep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("tp")[2] == [4, 5] and shape.coords(6)["rep"] == 1
    assert shape.rank_of(rep=1, dp=1, tp=1) == 7
    cfg = config.load("tiny", ["--parallel.replicas", "2", "--parallel.tp", "2"])
    assert shape_for(cfg, 8) == shape
    ft = config.load("tiny", ["--parallel.replicas", "2", "--parallel.dp", "4",
                              "--fault.mode", "replicas"])
    assert total_world(ft, 2) == 4 and shape_for(ft, 2) == MeshShape(dp=2)


@pytest.mark.parametrize("overrides, world, field", [
    (("--parallel.replicas", "3"), 4, "parallel.replicas=3"),
    (("--parallel.replicas", "2", "--parallel.ps_servers", "1"), 3, "parallel.ps_servers"),
    (("--parallel.sync", "local_sgd"), 2, "parallel.sync=local_sgd"),
    (("--parallel.replicas", "2", "--comm.compress", "topk"), 2, "comm.compress=topk"),
    (("--fault.advertise", "10.0.0.2"), 1, "fault.advertise"),
    (("--parallel.replicas", "2", "--fault.mode", "replicas", "--fault.advertise",
      "http://node1:80"), 2, "fault.advertise"),
    (("--parallel.replicas", "2", "--parallel.sync", "diloco", "--parallel.sync_every", "8",
      "--parallel.sync_fragments", "3"), 2, "parallel.sync_fragments=3"),
])
def test_refusals_name_the_field(overrides, world, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config.load("tiny", list(overrides)).validate(world)


def test_fragments_cut_the_tensors_into_equal_runs():
    tensors = [torch.arange(5.0), torch.arange(4.0).view(2, 2), torch.arange(2.0)]
    parts = fragments(tensors, 3)  # 11 elements: runs of 3, 4, 4
    assert [sum(v.numel() for v in p) for p in parts] == [3, 4, 4]
    assert torch.cat([v for p in parts for v in p]).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3,
                                                                 0, 1]
    parts[1][0].fill_(-1)  # views: writes reach the tensors
    assert tensors[0].tolist() == [0, 1, 2, -1, -1]


def test_fragment_k_syncs_at_its_offset():
    """H = 4, F = 2: fragment 0 after steps 4, 8, ..., fragment 1 after steps 2, 6, ..."""
    cfg = config.load("tiny", [*R2, "--parallel.sync", "diloco", "--parallel.sync_every", "4",
                               "--parallel.sync_fragments", "2"])
    view = ReplicaView(grads=list, weights=[torch.zeros(7)], refresh=lambda: None,
                       pieces=lambda *a: [], load=lambda *a: False)
    sync = ReplicaSync(cfg, None, view)
    due = {}
    for step in range(1, 9):
        sync.step = step
        due[step] = sync.due()
    assert due == {1: [], 2: [1], 3: [], 4: [0], 5: [], 6: [1], 7: [], 8: [0]}
    assert [sum(v.numel() for v in p) for p in sync.parts] == [3, 4]


def test_two_groups_equal_dp(tmp_path):
    """World 2, one spawn: every_step R=2 (dp=1 per group) against dp=2 (fp32 rtol 1e-5,
    weights 1e-4); local_sgd H=1 and diloco H=1 (outer lr 1, no momentum) against dp=2
    with SGD; diloco H=8 sends 1/8 of every_step's cross-replica bytes per step."""
    texts = [_text(tmp_path, "dp2"), _text(tmp_path, "r2", *R2),
             _text(tmp_path, "dp2-sgd", *SGD),
             _text(tmp_path, "local1", *R2, *SGD, "--parallel.sync", "local_sgd", *H1),
             _text(tmp_path, "diloco1", *R2, *SGD, *DILOCO_PLAIN),
             _text(tmp_path, "diloco8", *R2, "--parallel.sync", "diloco",
                   "--parallel.sync_every", "8", steps="8")]
    dp2, r2, sgd, local1, diloco1, diloco8 = run_distributed(train_layouts, 2, texts,
                                                             _rep_state)[0]
    assert_parity(dp2, r2, "replicas=2 every_step vs dp=2")
    assert_parity(sgd, local1, "local_sgd H=1 vs dp=2")
    assert_parity(sgd, diloco1, "diloco H=1 lr 1 momentum 0 vs dp=2")
    every, diloco = r2["rep_bytes"], diloco8["rep_bytes"]
    assert set(every) == {"rep:grad", "rep:metric"} and set(diloco) == {"rep:weights",
                                                                        "rep:metric"}
    every_per_step, diloco_per_step = every["rep:grad"] / 4, diloco["rep:weights"] / 8
    assert diloco_per_step * 8 == every_per_step > 0
    # the planner's rep group sends what the ledger recorded, per step, in both modes
    assert _planned(tmp_path, *R2) == {"rep:grad": every_per_step, "rep:weights": 0}
    assert _planned(tmp_path, *R2, "--parallel.sync", "diloco", "--parallel.sync_every",
                    "8") == {"rep:grad": 0, "rep:weights": diloco_per_step}


def _planned(tmp, *overrides: str) -> dict[str, float]:
    """The planner's cross-replica bytes per step of one rank of a world-2 tiny run."""
    cfg = tiny(tmp, "plan", *overrides)
    ops = step_ops(cfg.model, config_layout(cfg, 2), hardware.get("a100"),
                   seq_len=cfg.train.seq_len)
    return cross_replica_bytes(ops)


@pytest.mark.slow
def test_diloco_resumes_and_streams(tmp_path):
    """World 2: 2 fragments at H=4 move the bytes of F=1 at H=4 over 8 steps; DiLoCo
    resumes from its checkpoint (outer copy, momentum) exactly, and in one group (R=1)."""
    texts = [_text(tmp_path, "full4", *R2, "--parallel.sync", "diloco",
                   "--parallel.sync_every", "4", steps="8"),
             _text(tmp_path, "stream4", *R2, "--parallel.sync", "diloco",
                   "--parallel.sync_every", "4", "--parallel.sync_fragments", "2", steps="8"),
             _text(tmp_path, "diloco2", *R2, *DILOCO2, "--checkpoint.every", "2"),
             _text(tmp_path, "diloco2-resumed", *R2, *DILOCO2,
                   "--checkpoint.resume", _step(tmp_path, "diloco2", 2)),
             # AdamW (per-group moments) saved between syncs (per-group weights): each
             # group resumes its own state from the one checkpoint
             _text(tmp_path, "adam", *R2, *ADAM4, "--checkpoint.every", "2"),
             _text(tmp_path, "adam-resumed", *R2, *ADAM4,
                   "--checkpoint.resume", _step(tmp_path, "adam", 2))]
    ranks = run_distributed(train_layouts, 2, texts, _rep_state)
    full4, stream4, diloco2, resumed, *_ = ranks[0]
    for rank in ranks:  # group 0 (plain keys) and group 1 (its own, "replica1/")
        adam, adam_resumed = rank[4:]
        assert_parity({**adam, "losses": adam["losses"][2:]}, adam_resumed, "adam resumed")
    assert stream4["rep_bytes"]["rep:weights"] == full4["rep_bytes"]["rep:weights"] > 0
    # Weights synchronised at the saved step and SGD without momentum (no per-group
    # optimizer state): the resumed run continues exactly.
    assert_parity({**diloco2, "losses": diloco2["losses"][2:]}, resumed, "diloco resumed")
    for a, b in zip(diloco2["outer"], resumed["outer"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # In one group: its first step is the two groups' third on the same weights and batch.
    single = train_layout(0, 1, _text(tmp_path, "diloco2-in-one", "--optim.name", "sgd",
                                      "--optim.momentum", "0", "--checkpoint.resume",
                                      _step(tmp_path, "diloco2", 2), steps="3"))
    torch.testing.assert_close(single["losses"][0], diloco2["losses"][2], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_two_groups_equal_dp_for_inner_layouts(tmp_path):
    """World 4, one spawn: R=2 with ZeRO-2 over dp=2 per group (HSDP) against dp=4 ZeRO-2,
    and with tp=2 per group against dp=2 x tp=2 (fp32 rtol 1e-5, weights 1e-4); ZeRO-2
    local_sgd H=1 against dp=4 ZeRO-2 with SGD (the fp32 masters averaged, then gathered);
    in bf16 within the bf16 bound (parity.py), every_step and diloco H=1 (fp32 masters
    apart from the bf16 shards: the refresh casts them)."""
    zero2, tp2, bf16 = ("--parallel.zero", "2"), ("--parallel.tp", "2"), (
        "--train.precision", "bf16")
    pairs = {"zero2 dp2 x 2 groups": (zero2, (*zero2, *R2)),
             "tp2 x 2 groups": (tp2, (*tp2, *R2)),
             "zero2 local_sgd H=1": ((*zero2, *SGD), (*zero2, *SGD, *R2, "--parallel.sync",
                                                      "local_sgd", *H1)),
             "bf16 zero2 dp2 x 2 groups": ((*zero2, *bf16), (*zero2, *bf16, *R2)),
             "bf16 zero2 diloco H=1": ((*zero2, *bf16, *SGD),
                                       (*zero2, *bf16, *SGD, *R2, *DILOCO_PLAIN))}
    texts = [_text(tmp_path, f"{i}-{j}", *o) for i, pair in enumerate(pairs.values())
             for j, o in enumerate(pair)]
    per_rank = run_distributed(train_layouts, 4, texts)
    for rank, results in enumerate(per_rank):
        for i, label in enumerate(pairs):
            ref, got = results[2 * i], results[2 * i + 1]
            if "bf16" in label:
                assert worst_loss_deviation(ref["losses"], got["losses"]) < \
                    BF16_LOSS_RTOL[False], label
            else:
                assert_parity(ref, got, f"{label} rank {rank}")


def test_a_rank_state_moves_through_pieces(tmp_path):
    """What a rejoining group receives (parallel/replica/transfer.py): one trainer's pieces
    (weights, AdamW moments, step count) loaded into another, fresh one; one process."""
    trained = train_layout(0, 1, _text(tmp_path, "src", "--parallel.zero", "1", steps="2"),
                           _state_of)
    fresh = train_layout(0, 1, _text(tmp_path, "dst", "--parallel.zero", "1", steps="0"),
                         lambda t: _loaded(t, trained["state"]))
    for name, w in trained["weights"].items():
        torch.testing.assert_close(fresh["weights"][name], w, rtol=0, atol=0)
    got = PiecesReader(fresh["state"])
    for key, value in zip(trained["state"]["regions"], trained["state"]["values"]):
        torch.testing.assert_close(got.region(key[0], _region(key)), value, rtol=0, atol=0)
    assert fresh["state"]["extra"]["optim_steps"] == 2


def _state_of(trainer) -> dict:
    return {"state": pieces_state(trainer.parallel)}


def _loaded(trainer, state: dict) -> dict:
    trainer.parallel.load_state(PiecesReader(state))
    return {"weights": trainer.parallel.full_state_dict(), "state": pieces_state(trainer.parallel)}


def _region(key) -> Region:
    return Region(key[0], tuple(key[1]), tuple(key[2]), key[3], key[4])
