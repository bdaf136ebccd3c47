"""Replica groups under fault.mode=restart (parallel/replica/): R groups in one world equal
plain data parallelism of the same global batch (every_step, and local_sgd / diloco at
H = 1 with a linear optimizer); DiLoCo at H = 8 moves 1/8 of every_step's cross-replica
bytes; DiLoCo's outer state survives a checkpoint; the config refusals."""

from __future__ import annotations

import pytest

from dist import run_distributed
from parity import assert_parity, tiny, train_layouts
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.config.replicas import total_world
from shardtrain.mesh import MeshShape, shape_for

STEPS = "4"
R2 = ("--parallel.replicas", "2")
# local_sgd / diloco at H = 1 equal plain dp only where the optimizer's update is linear in
# the gradient (the mean of the groups' updates is then the update of the mean gradient):
# SGD with momentum (each group's buffer stays the mean's, by induction), no clipping
# (a per-group clip would scale each group's own norm).
SGD = ("--optim.name", "sgd", "--optim.momentum", "0.9", "--optim.grad_clip", "0",
       "--train.lr", "0.05")
H1 = ("--parallel.sync_every", "1")
DILOCO_PLAIN = ("--parallel.sync", "diloco", *H1, "--parallel.outer_lr", "1",
                "--parallel.outer_momentum", "0")


def _text(tmp, name: str, *overrides: str, steps: str = STEPS) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", steps, "--checkpoint.every", "0",
                               *overrides))


def _rep_bytes(trainer) -> dict:
    """This rank's bytes sent across groups, by ledger tag (rep:grad, rep:weights, ...)."""
    out: dict[str, int] = {}
    for r in trainer.mesh.ledger.records:
        if r.tag.startswith("rep:"):
            out[r.tag] = out.get(r.tag, 0) + r.sent_bytes
    return {"rep_bytes": out}


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
    (("--parallel.replicas", "2", "--parallel.sync", "diloco", "--parallel.sync_every", "8",
      "--parallel.sync_fragments", "3"), 2, "parallel.sync_fragments=3"),
])
def test_refusals_name_the_field(overrides, world, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config.load("tiny", list(overrides)).validate(world)


def test_two_groups_equal_dp(tmp_path):
    """World 2, one spawn: every_step R=2 (dp=1 per group) against dp=2 (fp32 rtol 1e-5,
    weights 1e-4); local_sgd H=1 and diloco H=1 (outer lr 1, no momentum) against dp=2
    with SGD; diloco H=8 sends 1/8 of every_step's cross-replica bytes."""
    texts = [_text(tmp_path, "dp2"), _text(tmp_path, "r2", *R2),
             _text(tmp_path, "dp2-sgd", *SGD),
             _text(tmp_path, "local1", *R2, *SGD, "--parallel.sync", "local_sgd", *H1),
             _text(tmp_path, "diloco1", *R2, *SGD, *DILOCO_PLAIN),
             _text(tmp_path, "every8", *R2, steps="8"),
             _text(tmp_path, "diloco8", *R2, "--parallel.sync", "diloco",
                   "--parallel.sync_every", "8", steps="8")]
    dp2, r2, sgd, local1, diloco1, every8, diloco8 = run_distributed(
        train_layouts, 2, texts, _rep_bytes)[0]
    assert_parity(dp2, r2, "replicas=2 every_step vs dp=2")
    assert_parity(sgd, local1, "local_sgd H=1 vs dp=2")
    assert_parity(sgd, diloco1, "diloco H=1 lr 1 momentum 0 vs dp=2")
    every, diloco = every8["rep_bytes"], diloco8["rep_bytes"]
    assert set(every) == {"rep:grad", "rep:metric"} and set(diloco) == {"rep:weights",
                                                                        "rep:metric"}
    assert diloco["rep:weights"] * 8 == every["rep:grad"] > 0
