"""The seeds' BERT example (examples/bert_ddp.py) under torchrun with 2 processes: a
`transformers` BERT trained by shardtrain's DataParallel over the ring all-reduce has the
loss curve of torch's DistributedDataParallel on the same model and batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_bert_example_matches_torch_ddp(tmp_path):
    out = tmp_path / "losses.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "bert_ddp.py"), "--steps", "4", "--max-bytes", "300000",
           "--vocab", "1000", "--compare-ddp", "--tokenizer-dir", str(tmp_path / "tok"),
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ours, ref = result["shardtrain_ring"], result["torch_ddp"]
    assert len(ours) == 4 and ours == pytest.approx(ref, rel=1e-5)
    assert ours[-1] < ours[0]
    assert result["algorithms"] == ["ring"] and result["grad_sent_bytes"] > 0
