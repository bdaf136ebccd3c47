"""GPU checks of the profiler (train/observe/profile.py): a trace of steps 2..3 with CUDA kernels in
it, and the allocator's memory snapshot written at the end of the run.

Run where CUDA exists: `python -m pytest tests/gpu -q -s`; skipped elsewhere (the CPU suite's
tests/test_tracking.py checks the CPU trace and that the snapshot is skipped there)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from parity import tiny
from shardtrain.mesh import MeshShape, ParallelMesh
from shardtrain.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these checks profile a GPU run")


def test_cuda_trace_and_memory_snapshot(tmp_path):
    cfg = tiny(tmp_path, "run", "--train.steps", "4", "--train.device", "cuda",
               "--train.profile_steps", "2:3", "--train.memory_snapshot", "true")
    Trainer(cfg, ParallelMesh(MeshShape()), torch.device("cuda")).run()
    profile = tmp_path / "run" / "profile"
    events = json.loads((profile / "trace_rank0.json").read_text())["traceEvents"]
    assert {"step 2", "step 3"} <= {e.get("name") for e in events}
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity recorded
    snapshot = pickle.loads((profile / "memory_snapshot_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]
