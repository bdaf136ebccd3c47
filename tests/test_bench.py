"""`shardtrain bench comm`'s statistic (bench/comm.py); the fit is in test_plan_cost.py."""

from __future__ import annotations

import pytest

from shardtrain.bench.comm import _statistic


def test_the_median_call_ignores_a_burst_of_load():
    """One call in ten delayed 10x (another process took the cores) leaves the figure
    where the other calls are; a mean would move by 90%."""
    calls = [1e-3, 1.1e-3, 0.9e-3, 1e-2, 1.05e-3, 0.95e-3, 1e-3, 1.02e-3, 0.98e-3, 1e-3]
    figures = _statistic(calls)
    assert figures["time_s"] == pytest.approx(1e-3, rel=0.03)
    assert figures["iters"] == 10 and figures["calls_s"] == calls
