"""Expert parallelism composed with the other dimensions (parallel/expert/): tensor (with
and without sequence parallelism), pipeline and context parallelism, and MoE under tp, sp
and cp without ep; parity with the single-process MoE run (fp32, dropless, balance and z
losses on: their token groups under cp and sp are expert/groups.py's), grad norms
included; and the five-dimensional row on 8 processes. ZeRO with ep: tests/test_ep_zero.py."""

from __future__ import annotations

import pytest
import torch

from shardtrain import config
from tests.dist import run_distributed
from tests.parity import assert_parity, tiny, train_layout, train_layouts
from tests.test_ep import MOE, _ep_records

CAPACITY = ("--model.moe_capacity_factor", "1.0", "--model.moe_drop_policy", "position")
ROWS = {
    4: [("ep2 x tp2", ("--parallel.ep", "2", "--parallel.tp", "2")),
        ("ep2 x tp2 sp", ("--parallel.ep", "2", "--parallel.tp", "2", "--parallel.sp", "true")),
        ("ep2 x pp2", ("--parallel.ep", "2", "--parallel.pp", "2")),
        ("ep2 x cp2", ("--parallel.ep", "2", "--parallel.cp", "2")),
        ("ep4 over dp2 x cp2", ("--parallel.ep", "4", "--parallel.cp", "2")),
        ("tp2 sp x cp2, no ep", ("--parallel.tp", "2", "--parallel.sp", "true",
                                 "--parallel.cp", "2")),
        # A capacity applies per rank's micro-batch: the single process's groups too. By
        # position (the earliest tokens keep their slots), the drops depend on the top-k
        # choices only, not on the last bits of the router probabilities.
        ("ep2 x dp2, capacity 1.0", ("--parallel.ep", "2", *CAPACITY))],
}


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, *MOE, *overrides))


@pytest.mark.parametrize("world", sorted(ROWS))
def test_ep_composes(tmp_path, world):
    rows = ROWS[world]
    references = {c: train_layout(0, 1, _text(tmp_path, f"ref{len(c)}", *c), _ep_records)
                  for c in ((), CAPACITY)}
    texts = [_text(tmp_path, f"row{i}-{world}", *o) for i, (_, o) in enumerate(rows)]
    per_rank = run_distributed(train_layouts, world, texts, _ep_records)
    for rank, runs in enumerate(per_rank):
        for (label, overrides), run in zip(rows, runs):
            reference = references[CAPACITY if "capacity" in label else ()]
            assert_parity(reference, run, f"{label} rank {rank}")
            assert (run["ep_calls"] > 0) == ("--parallel.ep" in overrides), label
            if run["dropped"] is not None:  # rank 0: slots over capacity, all replicas
                assert run["dropped"] == reference["dropped"], label
                assert (run["dropped"] > 0) == ("capacity" in label), label
            if run["grad_norms"] is not None:
                torch.testing.assert_close(torch.tensor(run["grad_norms"]),
                                           torch.tensor(reference["grad_norms"]), rtol=1e-5,
                                           atol=0, msg=f"{label}: grad norms differ")


FIVE_D = ("--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sp", "true",
          "--parallel.cp", "2", "--parallel.ep", "2", "--parallel.zero", "1")


def test_five_dimensions(tmp_path):
    """Eight processes, pp=2 x tp=2 (sp) x cp=2 x ep=2 with ZeRO-1: every dimension but
    dp, which would need 16 (ep is carved out of dp x cp = 2)."""
    reference = train_layout(0, 1, _text(tmp_path, "ref"), _ep_records)
    per_rank = run_distributed(train_layouts, 8, [_text(tmp_path, "5d", *FIVE_D)], _ep_records)
    for rank, (run,) in enumerate(per_rank):
        assert_parity(reference, run, f"5-D rank {rank}")
        assert run["ep_calls"] > 0
