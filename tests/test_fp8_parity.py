"""train.fp8 under the layouts it composes with: each row against the single-process run
of the same recipe and precision (same seed, same global batch), in one two-rank spawn.

Bounds. fp8's scales are taken from whole tensors (tensorwise) or rows (rowwise), so the
layouts that keep every linear's tensors whole -- dp (each rank's micro-batch is its own
tensor, as in accumulation), pp, recompute -- cast the same values with the same scales as
one process and differ only where the single-process run does too (fp32 sum order, and
bf16's layouts: parity.py BF16_LOSS_RTOL). Two rows round once more:
- ZeRO-3 in bf16 gathers the linears' weights in e4m3 (zero/fp8_gather.py): the same e4m3
  values as one process's, dequantized into bf16, so the layer recomputes its scale from
  bf16-rounded values: up to 2^-9 relative in the scale, the order of bf16's layout
  differences; bound 1e-3 (measured 4.6e-5; 2.0e-4 with the plain bf16 gather before).
- cp splits each sequence over ranks: a linear's input is the rank's tokens, whose amax
  (tensorwise: over the micro-batch's tensor) differs from the whole sequence's. The
  roundings then differ at e4m3's resolution (2^-4 relative) on single elements, which the
  loss averages: bound 1e-3 (measured 7.1e-5).
"""

from __future__ import annotations

import pytest

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, reference_runs, tiny, train_layouts,
                    worst_loss_deviation)
from shardtrain import config

pytest.importorskip("torchao", reason="train.fp8 needs the fp8 extra (torchao)")
pytestmark = pytest.mark.slow

STEPS = "4"
B8 = ("--train.global_batch", "8", "--train.micro_batch", "2")
# (label, recipe, precision, layout overrides, bound on the worst relative loss deviation)
ROWS = [
    ("dp2 accumulate", "tensorwise", "fp32", [], 1e-5),
    ("dp2 accumulate", "rowwise", "bf16", [], BF16_LOSS_RTOL[False]),
    ("zero3 dp2", "tensorwise", "bf16", ["--parallel.zero", "3"], BF16_LOSS_RTOL[False]),
    ("zero1 dp2", "rowwise", "fp32", ["--parallel.zero", "1"], 1e-5),
    ("pp2 1f1b recompute", "tensorwise", "bf16",
     ["--parallel.pp", "2", "--parallel.schedule", "1f1b",
      "--train.activation_checkpointing", "full"], BF16_LOSS_RTOL[False]),
    ("cp2", "tensorwise", "fp32", ["--parallel.cp", "2"], 1e-3),
]


def _text(tmp, name: str, recipe: str, precision: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *B8, "--train.fp8", recipe,
                               "--train.precision", precision, *overrides))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8")


def test_fp8_layouts_match_one_process(tmp):
    texts = [_text(tmp, f"row{i}", recipe, prec, *o)
             for i, (_, recipe, prec, o, _) in enumerate(ROWS)]
    per_rank = run_distributed(train_layouts, 2, texts, timeout_s=600)
    refs = reference_runs(lambda name, recipe, prec: _text(tmp, name, recipe, prec))
    print()
    for i, (label, recipe, prec, _, bound) in enumerate(ROWS):
        ref = refs((recipe, prec))
        worst = max(worst_loss_deviation(ref["losses"], ranks[i]["losses"])
                    for ranks in per_rank)
        print(f"{label:>20} {recipe:>10} {prec}: worst relative loss deviation {worst:.2e} "
              f"(bound {bound:.0e})")
        assert worst <= bound, f"{label} {recipe} {prec}"
    # fp8 computes: close to the run without it, not equal to it
    plain = reference_runs(lambda name: config.to_toml(
        tiny(tmp / "plain", name, "--train.steps", STEPS, *B8)))(())
    fp8 = refs(("tensorwise", "fp32"))
    assert fp8["losses"] != plain["losses"]
    assert worst_loss_deviation(plain["losses"], fp8["losses"]) < 1e-2
