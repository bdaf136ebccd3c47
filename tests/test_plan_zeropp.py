"""ZeRO++ and the optimizer taxonomy in the planner, without processes: the layout keys
(qwz, hpz, qgz, optim) parse, map to the training config and back, and are refused where
the trainer refuses them; the bytes per op follow the int8 wire format (values plus one
fp32 scale per block); `shardtrain plan --layout ...,qwz=1,hpz=1,qgz=1` prints them; the
optimizer's state count is the planner's K, and equals the runtime's ledger (one process,
ZeRO-2 and plain DP). Against the ledger of 4-rank runs: tests/test_zeropp_training.py."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from parity import make_mesh, tiny
from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.cli import main
from shardtrain.plan.layout import (PlanError, check, config_layout, layout_config,
                                    layout_overrides)
from shardtrain.plan.layout_text import parse_layout
from shardtrain.plan.memory import memory_per_gpu, model_states
from shardtrain.plan.rank_states import rank0_states
from shardtrain.plan.zeropp import packed_bytes
from shardtrain.train.trainer import Trainer

LLAMA = config.load("llama3-70b", []).model


def _layout(text: str, gpus: int = 512):
    return parse_layout(text, gpus=gpus, global_batch=512, precision="bf16")


def test_zeropp_keys_parse_map_and_are_refused_where_the_trainer_refuses():
    lay = _layout("dp=512,zero=3,qwz=1,hpz=1,qgz=1,optim=rmsprop")
    assert (lay.qwz, lay.hpz, lay.qgz, lay.optim) == (True, True, True, "rmsprop")
    assert lay.describe().endswith("qwz hpz qgz optim=rmsprop")
    cfg = config.load("llama3-70b", layout_overrides(lay, seq_len=8192))
    cfg.validate(512)
    p = cfg.parallel
    assert (p.zero_quantized_weights, p.zero_hpz, p.zero_quantized_gradients,
            cfg.optim.name) == (True, True, True, "rmsprop")
    assert config_layout(cfg, 512) == dataclasses.replace(lay, precision="amp")  # and back
    sgd = layout_config(_layout("dp=512,zero=1,optim=sgd"), LLAMA, seq_len=8192)
    assert (sgd.optim.name, sgd.optim.momentum) == ("sgd", 0.0)
    assert config_layout(sgd, 512).optim == "sgd"
    for text in ("dp=512,zero=2,hpz=1", "dp=512,zero=0,qwz=1", "dp=512,zero=0,qgz=1",
                 "dp=256,pp=2,zero=3,hpz=1", "dp=512,zero=3,optim=lion"):
        with pytest.raises(PlanError):
            check(_layout(text), LLAMA, gpus=512, node_size=8, global_batch=512, seq_len=8192)


def test_zeropp_bytes_follow_the_int8_wire_format():
    """One block of 256 int8 values and its fp32 scale: 260 bytes; a partial block pads."""
    assert packed_bytes(256) == 260 and packed_bytes(257) == 520 and packed_bytes(1) == 260


def test_cli_prints_the_quantized_bytes():
    """`shardtrain plan --model llama3-70b --gpus 512 --layout ...,qwz=1,hpz=1,qgz=1`: the
    dp ops are the int8 gathers (about half the bf16 ones), hpZ's node-local backward
    gathers, and qgZ's two hops (8 replicas per node, 64 nodes), whose inter-node hop
    carries 1/8 of the first's bytes per node (N - 1 of N chunks against (s - 1) N)."""
    docs = {}
    for opts in ("", ",qwz=1,hpz=1,qgz=1"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--model", "llama3-70b", "--gpus", "512", "--gpu", "a100", "--layout",
                         f"dp=512,zero=3,recompute=full{opts}", "--json"])
        assert code == 0
        docs[opts] = json.loads(out.getvalue())
    ops = {(o["op"], o["what"]): o for o in docs[",qwz=1,hpz=1,qgz=1"]["comm"]["ops"]}
    plain = {o["op"]: o for o in docs[""]["comm"]["ops"]}
    assert set(ops) == {("all_gather", "int8"), ("all_gather", "hpz"),
                        ("all_to_all", "int8 node"), ("all_to_all", "int8 inter")}
    assert ops["all_gather", "int8"]["ranks"] == 512 and ops["all_gather", "hpz"]["ranks"] == 8
    assert ops["all_to_all", "int8 node"]["ranks"] == 8
    assert ops["all_to_all", "int8 inter"]["ranks"] == 64
    # the plain gathers: P forward, P less the token table (gathered for forward only) backward
    forward = (plain["all_gather"]["bytes_sent"] + 2 * TABLE * 511 / 512) / 2
    ratio = ops["all_gather", "int8"]["bytes_sent"] / forward
    assert 0.5 < ratio < 0.52  # 260 / 512 bytes per value, plus the units' block padding
    node, inter = (ops["all_to_all", w]["bytes_sent"] for w in ("int8 node", "int8 inter"))
    assert inter / node == pytest.approx(63 / (7 * 64), rel=1e-3)
    memory = docs[",qwz=1,hpz=1,qgz=1"]["memory_per_gpu_bytes"]["params"]
    assert memory - docs[""]["memory_per_gpu_bytes"]["params"] == pytest.approx(
        2 * (LLAMA_PARAMS - TABLE) / 8, rel=1e-9)  # hpZ: 1/8 of the bf16 parameters gathered
    # for backward (not the token table)


LLAMA_PARAMS = 70_553_706_496
TABLE = 128_256 * 8_192  # Llama-3-70B's untied token table


@pytest.mark.parametrize("optim,states", [("adamw", 2), ("rmsprop", 1), ("adagrad", 1),
                                          ("momentum", 1), ("sgd", 0)])
def test_optimizer_states_are_the_planners_k(optim, states):
    """Seed 002: Adam 2 states, RMSProp, AdaGrad and momentum 1, SGD 0, 4 bytes each; K adds
    the bf16 convention's fp32 master (4 bytes)."""
    one = model_states(1, precision="bf16", optim=optim)
    assert one.optimizer == 4 * states and one.master + one.optimizer == 4 + 4 * states
    lay = _layout(f"dp=512,zero=3,recompute=full,optim={optim}")
    adam = _layout("dp=512,zero=3,recompute=full")
    hw = hardware.get("a100")
    got, ref = (memory_per_gpu(LLAMA, x, seq_len=8192, node_size=hw.node_size(512))
                for x in (lay, adam))
    assert got.optimizer - ref.optimizer == pytest.approx(
        4 * (states - 2) * LLAMA_PARAMS / 512, rel=1e-9)


@pytest.mark.parametrize("name,zero", [("rmsprop", "2"), ("adagrad", "0"), ("sgd", "0")])
def test_optimizer_bytes_equal_the_ledger(tmp_path, name, zero):
    """One process, ZeRO-2 (the shard optimizer: one fp32 state) and plain DP (torch's
    optimizer: Adagrad's sum and `step` tensor, vanilla SGD nothing): the ledger's
    model-state bytes are rank0_states' exactly."""
    cfg = tiny(tmp_path, f"{name}-{zero}", "--train.steps", "1", "--optim.name", name,
               "--optim.momentum", "0", "--parallel.zero", zero)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    trainer.train_step()
    ledger = trainer.memory_ledger()
    states = rank0_states(cfg.model, config_layout(cfg, 1), optimizer=name)
    for key in ("params", "grads", "master", "optimizer"):
        assert ledger[f"{key}_bytes"] == getattr(states, key), (name, zero, key)
