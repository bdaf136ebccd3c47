"""fault.mode = replicas through a failure (docs/faults.md): 4 processes, R = 2 groups of 2,
ZeRO-2 inside, one torchrun per group (the contract a cluster uses: SHARDTRAIN_REPLICA,
TORCHFT_LIGHTHOUSE), the lighthouse in this process.

Rank 3 (group 1's second process) is SIGKILLed after step 5; group 1's torchrun stops.
Group 0 never restarts (its workers' PIDs are the same throughout) and keeps stepping
alone; those steps read only group 0's share (the sampler's cursor moves by one group's
batch) and their losses equal a reference: one group (dp=2, ZeRO-2, the global batch of
one group) resumed from a no-failure run's step-5 checkpoint. Group 1 is then started again
(what its launcher's --max-restarts does; here the test, so that group 0's solo steps are
certain to happen first), receives group 0's state from it, not from disk, and from its
first step back steps in lockstep: the same losses, and bitwise the same final weights and
optimizer state. checkpoint.every = 0: nothing is read from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.parity import checkpoint_tensors, tiny_data
from shardtrain.train.checkpoint import checkpoint as ckpt

pytestmark = pytest.mark.slow
torchft = pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30
# Group 0's compute stretched 150x (a sleep after each forward, numerics unchanged): it is
# still stepping when group 1 comes back, however long group 1's start takes here.
SLOW = ["--train.slow_ranks", "0:150,1:150", "--train.straggler_factor", "0"]
COMMON = ["--config", "tiny", "--train.steps", str(STEPS), "--train.progress", "false",
          "--train.peak_flops", "1e12", "--train.log_every", "1", "--parallel.zero", "2",
          "--comm.timeout_s", "30"]
REPLICAS = [*COMMON, "--parallel.replicas", "2", "--fault.mode", "replicas",
            "--fault.quorum_timeout_s", "120", "--checkpoint.every", "0"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _group(tmp: Path, replica: int, lighthouse: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "0", "-m", "shardtrain", "train", *REPLICAS,
           "--train.run_dir", str(tmp / "ft"), *tiny_data(tmp), *extra]
    log = open(tmp / f"group{replica}.log", "a")
    return subprocess.Popen(cmd, env=_env(SHARDTRAIN_REPLICA=str(replica),
                                          TORCHFT_LIGHTHOUSE=lighthouse),
                            cwd=tmp, stdout=log, stderr=subprocess.STDOUT)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _workers(proc: subprocess.Popen) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _wait(what: str, done, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None or done(), f"group 0 ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _reference(tmp: Path) -> tuple[list[dict], list[dict]]:
    """One group on group 0's solo samples: a no-failure R=2 run's step-5 checkpoint (the
    mesh's replica groups, fault.mode=restart), resumed by dp=2 with one group's batch. The
    sampler's cursor carries over; its batch size is rewritten to one group's, which is
    what the failover's sampler reads while group 1 is out (data/sampler.py). Returns the
    no-failure run's records and the one group's."""
    run = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--nproc", "4", *COMMON,
                          "--parallel.replicas", "2", "--checkpoint.every", "5",
                          "--checkpoint.keep", "10",
                          "--train.run_dir", str(tmp / "whole"), *tiny_data(tmp)],
                         env=_env(), cwd=tmp, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    step5 = next(c for c in ckpt.list_checkpoints(tmp / "whole" / "checkpoints")
                 if ckpt.read_meta(c)["step"] == 5)
    meta = json.loads((step5 / "meta.json").read_text())
    meta["sampler"]["global_batch"] //= 2
    (step5 / "meta.json").write_text(json.dumps(meta))
    run = subprocess.run([sys.executable, "-m", "shardtrain", "train", "--nproc", "2", *COMMON,
                          "--train.global_batch", "4", "--checkpoint.resume", str(step5),
                          "--train.run_dir", str(tmp / "one"), *tiny_data(tmp)],
                         env=_env(), cwd=tmp, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return _records(tmp / "whole"), _records(tmp / "one")


def test_group_lost_and_rejoined_from_a_live_peer(tmp_path):
    from torchft.coordination import LighthouseServer

    from shardtrain.launch_replicas import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    dirs = [tmp_path / "ft" / f"replica_{r}" for r in (0, 1)]
    g0 = _group(tmp_path, 0, lighthouse.address(), "--train.inject_kill", "3:5", *SLOW)
    g1 = _group(tmp_path, 1, lighthouse.address(), "--train.inject_kill", "3:5")
    try:
        _wait("group 0's first step", lambda: _records(dirs[0]), g0)
        pids = _workers(g0)
        assert g1.wait(timeout=300) != 0  # its rank 1 was killed; no restart of its own
        solo = lambda: [r for r in _records(dirs[0]) if r["committed"] and r["quorum"] == 1]
        _wait("three steps of group 0 alone", lambda: len(solo()) >= 3, g0)
        g1 = _group(tmp_path, 1, lighthouse.address())  # its launcher's restart
        _wait("group 1's first step back", lambda: _records(dirs[1]), g0)
        assert _workers(g0) == pids and len(pids) >= 2  # group 0 never restarted
        assert g0.wait(timeout=300) == 0 and g1.wait(timeout=300) == 0
    finally:
        for proc in (g0, g1):  # SIGTERM: torchrun stops its workers, then itself
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        lighthouse.shutdown()
    logs = "".join((tmp_path / f"group{r}.log").read_text() for r in (0, 1))
    assert "resuming from" not in logs  # no checkpoint read

    r0 = _records(dirs[0])
    applied = [r for r in r0 if r["committed"]]
    assert [r["step"] for r in applied] == list(range(1, STEPS + 1))
    alone = [r for r in applied if r["quorum"] == 1]
    assert alone[0]["step"] == 6 and alone[0]["lost"] == [1] and alone[0]["groups"] == [0]
    assert all(r["groups"] == [0, 1] for r in applied if r["step"] <= 5)

    # Both groups on torchft equal the mesh's replica groups (fault.mode=restart, the same
    # global batch) while both live; the solo steps equal one group on its samples.
    whole, one = _reference(tmp_path)
    for r, w in zip(applied[:5], whole[:5]):
        assert r["loss"] == pytest.approx(w["loss"], rel=1e-5), r["step"]
    reference = {r["step"]: r["loss"] for r in one}
    for r in alone:
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=1e-5), r["step"]

    # Group 1 back: a peer's state, then lockstep with group 0.
    r1 = [r for r in _records(dirs[1]) if r["committed"]]
    first = r1[0]
    assert first["transfer_bytes"] > 0 and first["groups"] == [0, 1]
    assert any(r.get("rejoined") == [1] for r in r0)
    assert [r["step"] for r in r1] == list(range(first["step"], STEPS + 1))
    by_step = {r["step"]: r["loss"] for r in applied}
    assert all(r["loss"] == by_step[r["step"]] for r in r1)
    finals = [ckpt.list_checkpoints(d / "checkpoints")[-1] for d in dirs]
    for prefix in ("model/", "optim/"):
        want, got = (checkpoint_tensors(f, prefix) for f in finals)
        assert want.keys() == got.keys() and want
        for name, w in want.items():
            assert torch.equal(got[name], w), f"{prefix}{name} differs between the groups"
