"""Expert parallelism composed with the other dimensions (parallel/expert/): tensor (with
and without sequence parallelism), pipeline and context parallelism, and MoE under tp, sp
and cp without ep; parity with the single-process MoE run (fp32, dropless, balance and z
losses on: their token groups under cp and sp are expert/groups.py's), grad norms
included. The five-dimensional row is in tests/test_ep_zero.py's neighbour below."""

from __future__ import annotations

import pytest
import torch

from shardtrain import config
from tests.dist import run_distributed
from tests.parity import assert_parity, tiny, train_layout, train_layouts
from tests.test_ep import MOE, _ep_records

ROWS = {
    4: [("ep2 x tp2", ("--parallel.ep", "2", "--parallel.tp", "2")),
        ("ep2 x tp2 sp", ("--parallel.ep", "2", "--parallel.tp", "2", "--parallel.sp", "true")),
        ("ep2 x pp2", ("--parallel.ep", "2", "--parallel.pp", "2")),
        ("ep2 x cp2", ("--parallel.ep", "2", "--parallel.cp", "2")),
        ("ep4 over dp2 x cp2", ("--parallel.ep", "4", "--parallel.cp", "2")),
        ("tp2 sp x cp2, no ep", ("--parallel.tp", "2", "--parallel.sp", "true",
                                 "--parallel.cp", "2"))],
}


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, *MOE, *overrides))


@pytest.mark.parametrize("world", sorted(ROWS))
def test_ep_composes(tmp_path, world):
    rows = ROWS[world]
    reference = train_layout(0, 1, _text(tmp_path, "ref"), _ep_records)
    texts = [_text(tmp_path, f"row{i}-{world}", *o) for i, (_, o) in enumerate(rows)]
    per_rank = run_distributed(train_layouts, world, texts, _ep_records)
    for rank, runs in enumerate(per_rank):
        for (label, _), run in zip(rows, runs):
            assert_parity(reference, run, f"{label} rank {rank}")
            if run["grad_norms"] is not None:
                torch.testing.assert_close(torch.tensor(run["grad_norms"]),
                                           torch.tensor(reference["grad_norms"]), rtol=1e-5,
                                           atol=0, msg=f"{label}: grad norms differ")
