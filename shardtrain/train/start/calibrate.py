"""Measure this machine's compute for the planner's `cpu` preset.

The planner predicts compute time as FLOPs / (peak x efficiency). On a CPU the peak is the
measured throughput of a large fp32 matmul; the efficiency is what a whole training step
(forward, backward, AdamW) of a reference transformer achieves relative to that peak:
attention, norms, activations and the optimizer are not matmuls. The reference model is
deliberately not a preset, so that validating the planner on a preset is not circular.
Both figures are best-of-several: other load on the machine only ever slows a trial down,
so the fastest trial is the closest to what the machine can do.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from shardtrain.config import ModelConfig
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
