"""Timing two trainers fairly on a noisy machine: one step of each in turn."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved_tokens_per_s(runners: dict[str, Callable[[], object]], *, steps: int,
                             tokens_per_step: int) -> dict[str, float]:
    """Warm each runner up once, then run `steps` rounds of one step of each, alternating
    which goes first, so machine noise and drift hit all alike; tokens/s per runner."""
    for run in runners.values():
        run()
    elapsed = {name: 0.0 for name in runners}
    for i in range(steps):
        for name in (list(runners) if i % 2 else list(reversed(runners))):
            start = time.perf_counter()
            runners[name]()
            elapsed[name] += time.perf_counter() - start
    return {name: tokens_per_step * steps / t for name, t in elapsed.items()}
