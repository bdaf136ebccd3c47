"""train.fp8 under the layouts it composes with: each row against the single-process run
of the same recipe and precision (same seed, same global batch), in two-rank spawns (and
one of four).

Bounds. fp8's scales are taken from whole tensors (tensorwise) or rows (rowwise), so the
layouts that keep every linear's tensors whole -- dp (each rank's micro-batch is its own
tensor, as in accumulation), pp, recompute -- cast the same values with the same scales as
one process and differ only where the single-process run does too (fp32 sum order, and
bf16's layouts: parity.py BF16_LOSS_RTOL). Three rows round once more:
- ZeRO-3 in bf16 gathers the linears' weights in e4m3 (zero/fp8_gather.py): the same e4m3
  values as one process's, dequantized into bf16, so the layer recomputes its scale from
  bf16-rounded values: up to 2^-9 relative in the scale, the order of bf16's layout
  differences; bound 1e-3 (measured 4.6e-5; 2.0e-4 with the plain bf16 gather before).
- cp splits each sequence over ranks: a linear's input is the rank's tokens, whose amax
  (tensorwise: over the micro-batch's tensor) differs from the whole sequence's. The
  roundings then differ at e4m3's resolution (2^-4 relative) on single elements, which the
  loss averages: bound 1e-3 (measured 7.1e-5).
- pp in bf16 sends the residual stream across the stage boundary rounded to bf16
  (precision.md), so the next stage's linears cast rounded inputs: measured 4.9e-5.

Final weights, relative L2 per tensor. Where a layout changes what a linear casts, its
fp8 roundings of activations and output gradients (e4m3, e5m2: 2^-4, 2^-3 relative) land
differently on single elements, so each gradient element carries noise of that order while
the tensor's gradient agrees to ~1e-3 (its norm; the loss to 5e-5). Adam's first updates
are lr x sign(g) per element: an element whose gradient is below that noise flips sign and
its weight moves 2 lr the other way. About 1% of elements do, hence a relative L2 of ~1e-2
(measured 1.5e-2 under ZeRO-3 with fp8 gathers, 2.0e-2 with bf16 ones, 4e-5 without fp8;
pp 1.3e-2, cp 2.1e-2) and the RECAST bound 5e-2. ZeRO-1's rowwise fp32 row: rowwise rounds
every matmul result to bf16, where a different fp32 sum order flips single roundings, the
same way on fewer elements (4.5e-4; bound 5e-3).

Tensor parallelism (quant/float8_tp.py; two ranks, and tp x ZeRO-3, tp x pp on four): the
scales are agreed over tp, so tensorwise fp32 casts every element with the single
process's scale and differs by fp32 sum order only, as plain tp does: SAME (measured 9.3e-8
loss, 3.7e-5 weights, with and without sp: sp changes no cast). The other rows recast:
bf16's regions enter in bf16 (tensor/layers.py `to_compute`), so the linears cast
bf16-rounded inputs where one process casts fp32 ones (precision.md, "On this CPU"); and
rowwise returns each matmul in bf16, so a row-parallel linear's partial sums (and a
column-parallel one's input-gradient parts) are rounded before tp sums them: RECAST
(measured loss 4.9e-5 to 8.9e-5, weights 1.1e-2 to 2.0e-2).
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
SAME, BF16 = (1e-5, 1e-4), (BF16_LOSS_RTOL[False], 1e-3)  # fp32's and bf16's parity bounds
# A layout that changes what a linear casts (bf16 weights, a rank's share of the tokens):
# the loss holds bf16's bound; the weights see Adam amplify fp8's per-element noise (below)
RECAST = (BF16_LOSS_RTOL[False], 5e-2)
# (label, recipe, precision, layout overrides, (loss bound, weight bound))
ROWS = [
    ("dp2 accumulate", "tensorwise", "fp32", [], SAME),
    ("dp2 accumulate", "rowwise", "bf16", [], BF16),
    ("zero3 dp2", "tensorwise", "bf16", ["--parallel.zero", "3"], RECAST),
    ("zero1 dp2", "rowwise", "fp32", ["--parallel.zero", "1"], (1e-5, 5e-3)),
    ("pp2 1f1b recompute", "tensorwise", "bf16",
     ["--parallel.pp", "2", "--parallel.schedule", "1f1b",
      "--train.activation_checkpointing", "full"], RECAST),
    ("cp2", "tensorwise", "fp32", ["--parallel.cp", "2"], RECAST),
]
TP, SP = ["--parallel.tp", "2"], ["--parallel.tp", "2", "--parallel.sp", "true"]
TP_ROWS = [  # quant/float8_tp.py: scales agreed over tp (bounds: the docstring)
    (label, recipe, prec, o, SAME if (recipe, prec) == ("tensorwise", "fp32") else RECAST)
    for label, o in (("tp2", TP), ("tp2 sp", SP)) for recipe in ("tensorwise", "rowwise")
    for prec in ("fp32", "bf16")]
TP4_ROWS = [  # four ranks: tp with ZeRO-3 (whose gathers stay bf16 under tp: cost/fp8.py)
    ("tp2 zero3 dp2", "tensorwise", "bf16", [*SP, "--parallel.zero", "3"], RECAST),
    ("tp2 pp2 1f1b", "rowwise", "fp32", [*TP, "--parallel.pp", "2", "--parallel.schedule",
                                         "1f1b"], RECAST)]


def _text(tmp, name: str, recipe: str, precision: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *B8, "--train.fp8", recipe,
                               "--train.precision", precision, *overrides))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def refs(tmp):
    """The single-process run of each (recipe, precision), trained once for the module."""
    return reference_runs(lambda name, recipe, prec: _text(tmp, name, recipe, prec))


def _check(tmp, refs, rows: list, world: int = 2) -> None:
    """Train `rows` in one spawn of `world` ranks; each against its single-process run."""
    texts = [_text(tmp, f"row{i}-{world}-{len(rows)}", recipe, prec, *o)
             for i, (_, recipe, prec, o, _) in enumerate(rows)]
    per_rank = run_distributed(train_layouts, world, texts, timeout_s=600)
    print()
    failed = []
    for i, (label, recipe, prec, _, (loss_bound, weight_bound)) in enumerate(rows):
        ref = refs((recipe, prec))
        worst = max(worst_loss_deviation(ref["losses"], ranks[i]["losses"])
                    for ranks in per_rank)
        weights = max(((ranks[i]["weights"][n] - w).norm() / w.norm().clamp(min=1e-12)).item()
                      for ranks in per_rank for n, w in ref["weights"].items())
        print(f"{label:>20} {recipe:>10} {prec}: worst relative loss deviation {worst:.1e} "
              f"(bound {loss_bound:.0e}), final weights {weights:.1e} ({weight_bound:.0e})")
        if worst > loss_bound or weights > weight_bound:
            failed.append(f"{label} {recipe} {prec}")
    assert not failed, failed


def test_fp8_under_tp_matches_one_process(tmp, refs):
    _check(tmp, refs, TP_ROWS)
    _check(tmp, refs, TP4_ROWS, world=4)


def test_fp8_layouts_match_one_process(tmp, refs):
    _check(tmp, refs, ROWS)
    # fp8 computes: close to the run without it, not equal to it
    plain = reference_runs(lambda name: config.to_toml(
        tiny(tmp / "plain", name, "--train.steps", STEPS, *B8)))(())
    fp8 = refs(("tensorwise", "fp32"))
    assert fp8["losses"] != plain["losses"]
    assert worst_loss_deviation(plain["losses"], fp8["losses"]) < 1e-2
