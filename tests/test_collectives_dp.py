"""Data parallelism over every all-reduce algorithm, and with gradient compression: one
spawn of 4 processes (2 virtual nodes of 2, so hierarchical and the grids have two tiers)
trains the tiny preset once per setting.

- every algorithm that lays out 4 ranks (and auto) reproduces the native run: parity rtol
  1e-5 on losses, 1e-4 on weights, as the parity harness requires of any layout; mesh2d
  (2 x 2) also against the single-process run, fp32 and bf16;
- torus3d needs 8 ranks (2 x 2 x 2): its own spawn, in the slow tier, against the
  single-process run, fp32 and bf16;
- int8 moves ~4x fewer gradient bytes and ends within 1% of the uncompressed loss; top-k
  at 1% with error feedback moves >= 20x fewer and still learns (a short run; the loss
  figures of the default run come from benchmarks/compression_default_run.py).
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, reference_runs, tiny, train_layouts,
                    worst_loss_deviation)
from shardtrain import config
from shardtrain.cost.collectives import supported
from shardtrain.train.trainer import Trainer

WORLD = 4
STEPS = "10"
# Every all-reduce algorithm that lays out 4 ranks on nodes of 2 (not torus3d: 8 ranks;
# gather_broadcast is an all-gather), and auto.
ALGORITHMS = (*supported("all_reduce", WORLD, local_size=2), "auto")
BF16 = ("--train.precision", "bf16")
SETTINGS = [("algorithm", a) for a in ALGORITHMS] + [("compress", c) for c in ("int8", "topk")] \
    + [("algorithm", "mesh2d", "bf16")]
# Ten steps: top-k sends its ratio from the first (no sparsity warm-up), for the bytes bound.
EXTRA = {("compress", "topk"): ["--comm.topk_warmup_steps", "0"],
         ("algorithm", "mesh2d", "bf16"): list(BF16)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs of the same steps, fp32 and bf16."""
    tmp = tmp_path_factory.mktemp("dp_algorithms_ref")
    return reference_runs(lambda name, *o: config.to_toml(tiny(tmp, name, "--train.steps",
                                                               STEPS, *o)))


def _gradient_traffic(trainer: Trainer) -> dict:
    grads = [r for r in trainer.mesh.ledger.records if r.tag.startswith("grad")]
    return {"grad_bytes": sum(r.sent_bytes for r in grads),
            "algorithms": sorted({r.algorithm for r in grads})}


def _text(tmp, world: int, field: str, value: str, *rest: str) -> str:
    return config.to_toml(tiny(tmp, f"{world}-{field}-{value}{''.join('-' + r for r in rest)}",
                               "--train.steps", STEPS, "--comm.bucket_mb", "0.1",
                               "--parallel.node_size", "2", f"--comm.{field}", value,
                               *EXTRA.get((field, value, *rest), [])))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dp_algorithms")
    texts = [_text(tmp, WORLD, *setting) for setting in SETTINGS]
    per_rank = run_distributed(train_layouts, WORLD, texts, _gradient_traffic, timeout_s=600)
    return {setting: [r[i] for r in per_rank] for i, setting in enumerate(SETTINGS)}


def test_every_algorithm_reproduces_native_dp(runs):
    reference = runs[("algorithm", "native")][0]
    for (field, value, *rest), ranks in runs.items():
        if field != "algorithm" or rest:
            continue
        for rank, result in enumerate(ranks):
            assert_parity(reference, result, f"comm.algorithm={value} rank {rank}")
        if value not in ("native", "auto"):
            assert ranks[0]["algorithms"] == [value]
    print({v: round(r[0]["losses"][-1], 6) for (f, v, *_), r in runs.items()})


def test_compression_saves_bytes_and_still_learns(runs):
    plain = runs[("algorithm", "native")][0]
    for kind, min_ratio in (("int8", 3.8), ("topk", 20.0)):
        result = runs[("compress", kind)][0]
        ratio = plain["grad_bytes"] / result["grad_bytes"]
        final, base = result["losses"][-1], plain["losses"][-1]
        print(f"{kind}: {ratio:.1f}x fewer gradient bytes; final loss {final:.4f} vs {base:.4f}")
        assert ratio >= min_ratio, kind
        assert result["losses"][-1] < result["losses"][0], kind
        if kind == "int8":
            assert abs(final - base) <= 0.01 * base
        for rank in range(1, WORLD):  # replicas stay identical
            assert torch.equal(runs[("compress", kind)][rank]["weights"]["norm.weight"],
                               result["weights"]["norm.weight"])


def _against_one_process(rows: dict, references, label: str, same: tuple = ()) -> None:
    """fp32: the parity bounds on every rank; bf16: the precision suite's loss bound.
    `same`: overrides the single-process run shares with the rows."""
    for rank, result in enumerate(rows["fp32"]):
        assert_parity(references(same), result, f"{label} fp32 rank {rank}")
    reference, got = references((*same, *BF16)), rows["bf16"][0]
    worst = worst_loss_deviation(reference["losses"] + [reference["eval_loss"]],
                                 got["losses"] + [got["eval_loss"]])
    print(f"{label} bf16: worst relative loss deviation {worst:.2e}")
    assert worst <= BF16_LOSS_RTOL[False]


def test_mesh2d_dp4_matches_one_process(runs, references):
    _against_one_process({"fp32": runs[("algorithm", "mesh2d")],
                          "bf16": runs[("algorithm", "mesh2d", "bf16")]}, references,
                         "dp=4 mesh2d (2 x 2)")


@pytest.mark.slow
def test_torus3d_dp8_matches_one_process(tmp_path, references):
    """dp=8 on 4 virtual nodes of 2: a 2 x 2 x 2 torus, every gradient byte on it."""
    micro = ("--train.micro_batch", "1")  # the tiny preset's global batch of 8 over 8 ranks
    EXTRA[("algorithm", "torus3d")] = list(micro)
    EXTRA[("algorithm", "torus3d", "bf16")] = [*micro, *BF16]
    texts = [_text(tmp_path, 8, "algorithm", "torus3d"),
             _text(tmp_path, 8, "algorithm", "torus3d", "bf16")]
    per_rank = run_distributed(train_layouts, 8, texts, _gradient_traffic, timeout_s=900)
    rows = {"fp32": [r[0] for r in per_rank], "bf16": [r[1] for r in per_rank]}
    assert rows["fp32"][0]["algorithms"] == ["torus3d"]
    _against_one_process(rows, references, "dp=8 torus3d (2 x 2 x 2)", micro)
