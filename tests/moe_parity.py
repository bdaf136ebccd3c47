"""The parity rows an MoE routing or expert shape must pass (tests/test_moe_routing.py,
tests/test_moe_experts.py): one process against ep=2, tp=2, pp=2, cp=2, dp=2 x ZeRO-3 on 2
ranks and ep=2 x dp=2 x ZeRO-2 on 4, fp32 (losses, weights, the expert biases bitwise) and
bf16 (the bf16 loss bound) for ep, pp and ep x dp x ZeRO-2."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dist import run_distributed
from parity import BF16_LOSS_RTOL, assert_parity, train_layout, train_layouts, worst_loss_deviation

BF16 = ("--train.precision", "bf16")


def check_moe_layouts(text: Callable[..., str], extra: Callable, tp: tuple[str, ...]
                      ) -> tuple[dict, dict[str, list[dict]]]:
    """`text(name, *overrides)` a run's TOML, `extra(trainer)` a dict with "bias" (the
    expert biases by name); `tp`: the tp row's overrides. Asserts every row; returns the
    fp32 reference and each row's per-rank results."""
    reference = train_layout(0, 1, text("ref"), extra)
    reference16 = train_layout(0, 1, text("ref16", *BF16))
    rows = [("ep2", ("--parallel.ep", "2")), ("tp2", tp), ("pp2", ("--parallel.pp", "2")),
            ("cp2", ("--parallel.cp", "2")), ("dp2 zero3", ("--parallel.zero", "3")),
            ("ep2 bf16", ("--parallel.ep", "2", *BF16)), ("pp2 bf16", ("--parallel.pp", "2", *BF16))]
    wide = [("ep2 dp2 zero2", ("--parallel.ep", "2", "--parallel.zero", "2")),
            ("ep2 dp2 zero2 bf16", ("--parallel.ep", "2", "--parallel.zero", "2", *BF16))]
    out = {}
    for world, layouts in ((2, rows), (4, wide)):
        per_rank = run_distributed(train_layouts, world,
                                   [text(n.replace(" ", "-"), *o) for n, o in layouts], extra)
        for i, (label, _) in enumerate(layouts):
            out[label] = [results[i] for results in per_rank]
            for rank, got in enumerate(out[label]):
                if "bf16" in label:
                    worst = worst_loss_deviation(reference16["losses"], got["losses"])
                    assert worst <= BF16_LOSS_RTOL["tp" in label], (label, rank, worst)
                    continue
                assert_parity(reference, got, f"{label} rank {rank}")
                for name, bias in reference["bias"].items():
                    assert torch.equal(got["bias"][name], bias), (label, rank, name)
    return reference, out
