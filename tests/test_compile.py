"""Compiled blocks (train.compile, parallel/compile.py): compiled training matches eager
training on the layouts whose block has something special inside or around it, with no
recompilation after the first step (evaluation and sampling run eagerly) and the same
collectives in the ledger; the refused layout is refused before any work, and the planner
never proposes compile.

Compiling is the slow part (inductor's C++ on a busy 2-core machine: ~20 s per new graph
cold, seconds from the on-disk cache), so one two-rank spawn trains five compiled configs
that between them cover: ZeRO-3's hooks and resized parameter storage with checkpointed
blocks; the eager islands of a context-parallel core and an expert-parallel MoE layer; bf16
autocast on pipeline stages with checkpointed attention cores; tensor parallelism, and
sequence parallelism, whose collectives the block's graph holds as custom ops. Each is
compared with the same config trained eagerly. The first and third compile with inductor
(the kernels a run gets); the others are about what dynamo and AOT autograd make of a
block (where the graph breaks; for sp, which graph re-gathers the input), which tracing
without code generation shows the same, in a fraction of the time: `aot_eager`, or with
the tp rows inductor's partitioner too (`aot_eager_decomp_partition`), which decides what
the forward saves for backward.
"""

from __future__ import annotations

import functools
from collections import Counter
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from dist import run_distributed
from parity import BF16_LOSS_RTOL, assert_parity, tiny, train_layout, worst_loss_deviation
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.plan.layout import Layout, layout_config, layout_overrides

COMPILE = torch.compile  # parallel/compile.py's, given each row's backend by _runs
STEPS = ("--train.steps", "3", "--train.eval_every", "2", "--train.eval_batches", "1")
TP = ("--parallel.tp", "2")
ROWS = [  # label, overrides, precision bound (None: fp32 parity, parity.py), backend
    ("zero3 + full checkpointing", ["--parallel.zero", "3", "--train.activation_checkpointing",
                                    "full", "--train.sample_tokens", "4"], None, "inductor"),
    ("cp2 ring x ep2 MoE", ["--parallel.cp", "2", "--model.n_experts", "2", "--parallel.ep",
                            "2"], None, "aot_eager"),
    ("bf16 pp2 + selective checkpointing", ["--train.precision", "bf16", "--parallel.pp", "2",
                                            "--train.activation_checkpointing", "selective"],
     BF16_LOSS_RTOL[False], "inductor"),
    ("tp2", [*TP], None, "aot_eager_decomp_partition"),
    ("tp2 + sp", [*TP, "--parallel.sp", "true"], None, "aot_eager_decomp_partition"),
]
# The most graphs a block may compile to, per layout (the rows above not named: no bound).
# The blocks share their graphs (one code, one set of guards), so a run's unique graphs are
# one block's. Tensor parallelism's collectives are ops inside the graph: one graph.
MAX_GRAPHS = {"tp2": 2, "tp2 + sp": 2}


def _ledger(trainer) -> dict:
    """Every collective the run made, counted by what it was (op, group, tag, elements)."""
    return {"comm": Counter((r.op, r.group, r.tag, r.numel, r.sent_bytes)
                            for r in trainer.mesh.ledger.records)}


def _runs(rank: int, world_size: int, texts: list[str], backends: list[str]) -> list[dict]:
    """Each config on this rank, with a fresh compile cache and recompilation an error:
    after a block's first call, no step, evaluation or sample may compile again."""
    out = []
    for text, backend in zip(texts, backends):
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True), \
                mock.patch.object(torch, "compile", functools.partial(COMPILE, backend=backend)):
            out.append(train_layout(rank, world_size, text, _ledger))
        out[-1]["graphs"] = counters["stats"]["unique_graphs"]
        out[-1]["breaks"] = sum(counters["graph_break"].values())
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("compile")
    texts = [config.to_toml(tiny(tmp, f"{i}-{c}", *STEPS, *o, "--train.compile", c))
             for i, (_, o, _, _) in enumerate(ROWS) for c in ("false", "true")]
    backends = [backend for *_, backend in ROWS for _ in range(2)]
    return run_distributed(_runs, 2, texts, backends)[0]


def test_compiled_blocks_match_eager(world2):
    for i, (label, _, bound, _) in enumerate(ROWS):
        eager, compiled = world2[2 * i], world2[2 * i + 1]
        print(f"{label}: {compiled['graphs']} graphs, {compiled['breaks']} graph breaks")
        assert eager["graphs"] == 0 and 0 < compiled["graphs"] <= MAX_GRAPHS.get(label, 99), label
        # The communicator records each call the graph makes: the same calls as eagerly
        # (under sp: one re-gather per region in backward, not one per linear).
        assert compiled["comm"] == eager["comm"], label
        if bound is None:
            assert_parity(eager, compiled, f"compiled {label}")
            continue
        # bf16: the loss bound of tests/test_precision.py (Adam's normalised update turns
        # bf16-sized gradient differences into lr-sized weight ones: losses are compared).
        worst = worst_loss_deviation(eager["losses"] + [eager["eval_loss"]],
                                     compiled["losses"] + [compiled["eval_loss"]])
        print(f"{label}: worst relative loss deviation compiled vs eager {worst:.2e}")
        assert 0 < worst <= bound, label  # > 0: the compiled kernels did run


def test_refused_layout_names_both_fields(tmp_path):
    cfg = tiny(tmp_path, "bad", "--train.compile", "true", "--parallel.ps_servers", "1")
    with pytest.raises(ConfigError, match=r"train.compile=true with parallel.ps_servers=1: .* "
                                          r"set parallel.ps_servers=0 or train.compile=false"):
        cfg.validate(3)
    cfg = tiny(tmp_path, "zb", "--train.compile", "true", "--parallel.pp", "2",
               "--parallel.schedule", "zb-h1")
    with pytest.raises(ConfigError, match=r"train.compile=true with parallel.schedule=zb-h1: .* "
                                          r"set train.compile=false or parallel.schedule=1f1b"):
        cfg.validate(2)
    for _, overrides, *_ in ROWS:  # what the rows above train compiled is accepted
        tiny(tmp_path, "ok", "--train.compile", "true", *overrides).validate(2)
    assert not tiny(tmp_path, "default").train.compile  # off unless asked for


def test_planner_never_sets_compile():
    """A plan's layout runs eagerly: compile is the user's choice, added to a plan's
    overrides (which then pass the same validation as any config)."""
    layout = Layout(dp=1, tp=2, pp=1, cp=1, micro_batch=1, microbatches=1)
    assert not any("compile" in o for o in layout_overrides(layout))
    cfg = config.load("tiny")
    assert not layout_config(layout, cfg.model, seq_len=32).train.compile
