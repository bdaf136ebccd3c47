"""A real two-node run on one machine (examples/two_nodes.sh): two network namespaces
joined by a veth pair, one torchrun per namespace meeting by c10d rendezvous, training the
tiny model at tp=2 (inside each node) x dp=2 (across the link). Its per-step losses and
eval loss equal the same layout's on one node (node size 2 there too, so every group and
algorithm is the same). Skipped where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity import tiny_data

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "two_nodes.sh"
ARGS = ["--config", "tiny", "--parallel.tp", "2", "--train.steps", "4",
        "--train.eval_every", "4", "--train.progress", "false"]


def _can_make_namespaces() -> str | None:
    """None if network namespaces can be created here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"stprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _losses(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], rows[-1]["eval_loss"]


@pytest.mark.slow  # three launches of fresh interpreters: 25 s of the README command's 10 minutes
def test_two_nodes_train_as_one(tmp_path):
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cache = tiny_data(tmp_path)
    # The one-node reference through shardtrain's own launcher (workers forked from a
    # process that imported torch once; torchrun's import it each: seconds per rank).
    # test_cli.py runs under torchrun itself.
    one = subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", "--nproc", "4", *ARGS,
         "--parallel.node_size", "2", "--train.run_dir", str(tmp_path / "one"), *cache],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(["bash", str(SCRIPT), "2", *ARGS, "--train.run_dir",
                          str(tmp_path / "two"), *cache],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    (a, eval_a), (b, eval_b) = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    print(f"one node: {a} eval {eval_a}\ntwo nodes: {b} eval {eval_b}")
    assert len(a) == 4 and a == pytest.approx(b, rel=1e-6, abs=0)
    assert eval_a == pytest.approx(eval_b, rel=1e-6, abs=0)
