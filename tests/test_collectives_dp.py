"""Data parallelism over every all-reduce algorithm, and with gradient compression: one
spawn of 4 processes (2 virtual nodes of 2, so hierarchical and torus have two tiers)
trains the tiny preset once per setting.

- every algorithm (and auto) reproduces the native run: parity rtol 1e-5 on losses, 1e-4 on
  weights, as the parity harness requires of any layout;
- int8 moves ~4x fewer gradient bytes and ends within 1% of the uncompressed loss; top-k
  at 1% with error feedback moves >= 20x fewer and still learns (a short run; the loss
  figures of the default run come from benchmarks/compression_default_run.py).
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from parity import assert_parity, tiny, train_layouts
from shardtrain import config
from shardtrain.comm.dispatch import ALGORITHMS
from shardtrain.train.trainer import Trainer

WORLD = 4
STEPS = "10"
SETTINGS = [("algorithm", a) for a in ALGORITHMS] + [("compress", c) for c in ("int8", "topk")]
# Ten steps: top-k sends its ratio from the first (no sparsity warm-up), for the bytes bound.
EXTRA = {("compress", "topk"): ["--comm.topk_warmup_steps", "0"]}


def _gradient_traffic(trainer: Trainer) -> dict:
    grads = [r for r in trainer.mesh.ledger.records if r.tag.startswith("grad")]
    return {"grad_bytes": sum(r.sent_bytes for r in grads),
            "algorithms": sorted({r.algorithm for r in grads})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dp_algorithms")
    texts = [config.to_toml(tiny(tmp, f"{field}-{value}", "--train.steps", STEPS,
                                 "--comm.bucket_mb", "0.1", "--parallel.node_size", "2",
                                 f"--comm.{field}", value, *EXTRA.get((field, value), [])))
             for field, value in SETTINGS]
    per_rank = run_distributed(train_layouts, WORLD, texts, _gradient_traffic, timeout_s=600)
    return {setting: [r[i] for r in per_rank] for i, setting in enumerate(SETTINGS)}


def test_every_algorithm_reproduces_native_dp(runs):
    reference = runs[("algorithm", "native")][0]
    for (field, value), ranks in runs.items():
        if field != "algorithm":
            continue
        for rank, result in enumerate(ranks):
            assert_parity(reference, result, f"comm.algorithm={value} rank {rank}")
        if value not in ("native", "auto"):
            assert ranks[0]["algorithms"] == [value]
    print({v: round(r[0]["losses"][-1], 6) for (f, v), r in runs.items()})


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
