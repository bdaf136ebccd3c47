"""fault.mode = replicas with no failure equals plain data parallelism of the same global
batch (fp32: losses rtol 1e-5, final weights 1e-4): R = 2 groups on torchft, launched as a
user does (`shardtrain train --nproc N`: a lighthouse and one launch per group), for the
inner layouts dp = 1, ZeRO-2 over dp = 2 and tp = 2 (docs/faults.md); and DiLoCo on torchft
equals DiLoCo over the mesh's groups. Each group writes its
own run dir (<run_dir>/replica_<r>); both groups' records and final weights are compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parity import LOSS_RTOL, WEIGHT_TOL, checkpoint_tensors, tiny_data
from shardtrain.train.checkpoint import checkpoint as ckpt

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--config", "tiny", "--train.steps", "4", "--train.progress", "false",
          "--train.peak_flops", "1e12", "--train.log_every", "1", "--checkpoint.every", "0"]


def _train(tmp: Path, name: str, nproc: int, *extra: str) -> Path:
    run_dir = tmp / name
    run = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--nproc", str(nproc),
                          *COMMON, "--train.run_dir", str(run_dir), *tiny_data(tmp), *extra],
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         cwd=tmp, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run_dir


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


DILOCO = ("--parallel.replicas", "2", "--parallel.sync", "diloco", "--parallel.sync_every", "2")


@pytest.mark.parametrize("nproc,inner,sync", [(2, (), ()), (4, ("--parallel.zero", "2"), ()),
                                              (4, ("--parallel.tp", "2"), ()), (2, (), DILOCO)],
                         ids=["dp1", "zero2-dp2", "tp2", "diloco-h2"])
def test_replicas_without_failure_equal_dp(tmp_path, nproc, inner, sync):
    """Against dp of the same global batch; DiLoCo against the mesh's replica groups
    (fault.mode=restart) under the same sync (the last step a sync: one model)."""
    dp = _train(tmp_path, "dp", nproc, *inner, *sync)
    ft = _train(tmp_path, "ft", nproc, *inner, *(sync or ("--parallel.replicas", "2")),
                "--fault.mode", "replicas")
    want = torch.tensor(_losses(dp))
    final = ckpt.list_checkpoints(dp / "checkpoints")[-1]
    weights = checkpoint_tensors(final)
    for r in (0, 1):
        group = ft / f"replica_{r}"
        torch.testing.assert_close(torch.tensor(_losses(group)), want, rtol=LOSS_RTOL, atol=0)
        got = checkpoint_tensors(ckpt.list_checkpoints(group / "checkpoints")[-1])
        assert got.keys() == weights.keys()
        for name, w in weights.items():
            torch.testing.assert_close(got[name], w, rtol=WEIGHT_TOL, atol=WEIGHT_TOL,
                                       msg=lambda m: f"group {r}: {name} differs\n{m}")
