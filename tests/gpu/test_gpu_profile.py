"""GPU checks of the profiler (train/observe/profile.py): a trace of steps 2..3 with the
step's operators and, on a GPU, its CUDA kernels in it (read by the GPU check's audit,
benchmarks/gpu/audit.py), and the allocator's memory snapshot written at the end of the run.

The CPU twin trains the same config on the CPU: a trace with the same ranges and operators;
no kernels, and the snapshot is skipped there (it records the CUDA caching allocator)."""

from __future__ import annotations

import json
import pickle

from audit import trace_audit
from harness import one_process
from parity import tiny


def test_trace_and_memory_snapshot(tmp_path, device):
    cfg = tiny(tmp_path, "run", "--train.steps", "4", "--train.device", device.type,
               "--train.profile_steps", "2:3", "--train.memory_snapshot", "true")
    one_process(cfg, device).run()
    profile = tmp_path / "run" / "profile"
    found = trace_audit(json.loads((profile / "trace_rank0.json").read_text()), 2)
    print(f"\n{device.type}: {found}")
    assert found["steps_traced"] == ["step 2", "step 3"]
    assert found["attention"], "no attention operator in the trace"
    snapshots = list(profile.glob("memory_snapshot_rank*.pickle"))
    if device.type == "cuda":
        assert found["kernels_per_step"] > 0  # CUDA activity recorded
        snapshot = pickle.loads(snapshots[0].read_bytes())
        assert snapshot["segments"] and snapshot["device_traces"][0]
    else:
        assert not snapshots
