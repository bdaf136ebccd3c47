"""ZeRO-3 gathers the blocks' fp8 weights in e4m3 (parallel/zero/fp8_gather.py): per step
the ledger's dp bytes equal the planner's (plan/traffic.py step_ops, with its fp8 terms),
units gathered per micro-batch or, with unsharded accumulation, once per step (as under a
pipeline); the bf16 weights gathered in fp8 cost at most 0.55 of their bf16 gather. One
spawn of two ranks, one step per run, the tiny preset at 4 layers of width 96
(test_wire_dtypes.py's shape and its one-step worker). Numbers: test_fp8_parity.py.
"""

from __future__ import annotations

import pytest

from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.layout import config_layout
from shardtrain.plan.traffic import step_ops
from tests.dist import run_distributed
from tests.parity import tiny
from tests.test_wire_dtypes import SHAPE, _one_step

pytest.importorskip("torchao", reason="train.fp8 needs the fp8 extra (torchao)")

ZERO3 = ("--parallel.zero", "3", "--train.precision", "bf16")
RUNS = {"bf16": (), "tensorwise": ("--train.fp8", "tensorwise"),
        "rowwise": ("--train.fp8", "rowwise"),  # per-row scales: gathered in bf16
        "tensorwise 2 blocks per unit": ("--train.fp8", "tensorwise",
                                         "--parallel.zero_unit_blocks", "2"),
        # units gathered once per step and kept (as under a pipeline): one amax each
        "tensorwise unsharded": ("--train.fp8", "tensorwise",
                                 "--parallel.zero_accumulate", "unsharded")}
DP_TAGS = ("param", "param:fp8", "param:amax", "grad")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fp8zero")
    cfgs = {name: tiny(tmp, name.replace(" ", "_"), *SHAPE, *ZERO3, *o)
            for name, o in RUNS.items()}
    per_rank = run_distributed(_one_step, 2, [config.to_toml(c) for c in cfgs.values()])
    return {name: (cfg, [per_rank[r][i] for r in range(2)])
            for i, (name, cfg) in enumerate(cfgs.items())}


def test_ledger_equals_the_planner_and_fp8_halves_the_weights_gathers(runs):
    hw = hardware.get("h100")
    for name, (cfg, ranks) in runs.items():
        planned = sum(op.bytes_sent for op in step_ops(cfg.model, config_layout(cfg, 2), hw,
                                                       seq_len=cfg.train.seq_len)
                      if op.group == "dp")
        for r in ranks:
            sent = sum(r["by_tag"].get(t, 0) for t in DP_TAGS)
            print(f"{name}: ledger {sent} B, planner {planned:.0f} B")
            assert sent == pytest.approx(planned, abs=8), name
    bf16, fp8 = runs["bf16"][1][0]["by_tag"], runs["tensorwise"][1][0]["by_tag"]
    assert "param:fp8" not in runs["rowwise"][1][0]["by_tag"]
    # the same units' gathers: bf16's all, less what fp8's run still gathers in bf16/fp32
    weights_bf16 = bf16["param"] - fp8["param"]
    ratio = (fp8["param:fp8"] + fp8["param:amax"]) / weights_bf16
    print(f"fp8 gathers (with their amax all-reduces) / bf16 gathers of the same weights: "
          f"{ratio:.3f}")
    assert 0.5 <= ratio <= 0.55
