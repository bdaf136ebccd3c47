"""Measure this machine's compute for the planner's `cpu` preset.

The planner predicts compute time as FLOPs / (peak x efficiency). On a CPU the peak is the
measured throughput of a large fp32 matmul; the efficiency is what a whole training step
(forward, backward, AdamW) of a reference transformer achieves relative to that peak:
attention, norms, activations and the optimizer are not matmuls. The reference model is
deliberately not a preset, so that validating the planner on a preset is not circular.
Both figures are best-of-several: other load on the machine only ever slows a trial down,
so the fastest trial is the closest to what the machine can do.

The runtime base (`runtime_base`), for the CPU dry run's predicted peak: a fresh process
runs the dry run of the `tiny` preset (2 ranks, one step), whose tensors are a few MB, and
the base is its resident peak less its step peak in tensor bytes (model states plus
malloc's growth, meters.py): what the interpreter, torch and malloc hold besides tensors.
Measured once per machine and torch version, stored (cost/calibration.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from shardtrain.config import ModelConfig
from shardtrain.cost import calibration
from shardtrain.model.transformer import build_model
from shardtrain.cost.counts import model_flops_per_token
from shardtrain.train.observe.metrics import measure_matmul_flops

REFERENCE = ModelConfig(style="llama", vocab_size=256, dim=384, n_layers=2, n_heads=6,
                        max_seq_len=128)
REFERENCE_BATCH = 8


def measure_compute(*, steps: int = 6) -> tuple[float, float]:
    """(peak FLOP/s, efficiency) of this process with its current thread count."""
    peak = measure_matmul_flops()
    model = build_model(REFERENCE, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = REFERENCE.max_seq_len
    batch = torch.randint(0, REFERENCE.vocab_size, (REFERENCE_BATCH, seq + 1),
                          generator=torch.Generator().manual_seed(0))
    inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, S] each
    times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    flops = model_flops_per_token(REFERENCE, seq) * REFERENCE_BATCH * seq
    return peak, flops / min(times[1:]) / peak


def measure_runtime_bytes() -> int:
    """The runtime base of this machine (module docstring), measured in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="shardtrain-runtime-") as run_dir:
        code = ("import json, sys, torch; from shardtrain.config import load; "
                "from shardtrain.train.start.dryrun import dry_run; "
                f"cfg = load('tiny', ['--train.run_dir={run_dir}', '--train.steps=1']); "
                "r = dry_run(cfg, 2, torch.device('cpu'), runtime_bytes=0, quiet=True); "
                "print(json.dumps(r['measured']))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    return max(0, int(measured["peak_mem"]) - int(measured["step_peak"]))


def runtime_base(path: str | None = None) -> calibration.RuntimeBase:
    """The stored runtime base for this torch, measured and stored first if there is none."""
    base = calibration.load_runtime(torch.__version__, path)
    if base is None:
        base = calibration.RuntimeBase(bytes=measure_runtime_bytes(), torch=torch.__version__,
                                       measured_at=datetime.now(timezone.utc).isoformat())
        calibration.save_runtime(base, path)
    return base
