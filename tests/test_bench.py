"""`shardtrain bench comm`: its statistic (bench/comm.py) and one small run end to end; the fit
is tested in test_plan_cost.py."""

from __future__ import annotations

import json

import pytest

from shardtrain.bench.comm import _statistic


def test_the_median_call_ignores_a_burst_of_load():
    """One call in ten delayed 10x (another process took the cores) leaves the figure
    where the other calls are; a mean would move by 90%."""
    calls = [1e-3, 1.1e-3, 0.9e-3, 1e-2, 1.05e-3, 0.95e-3, 1e-3, 1.02e-3, 0.98e-3, 1e-3]
    figures = _statistic(calls)
    assert figures["time_s"] == pytest.approx(1e-3, rel=0.03)
    assert figures["iters"] == 10 and figures["calls_s"] == calls


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_bench_comm_end_to_end(tmp_path, capsys):
    """Two processes, two ops, sizes 1 and 8 KiB: every algorithm that serves the op is
    timed at every size, busbw follows nccl-tests, the model predicts every fitted row,
    auto is compared with rivals timed in the same turns, and the plot is written."""
    from shardtrain.bench import main
    from shardtrain.comm.dispatch import serves
    from shardtrain.cost import collectives as cost

    plot, doc_path = tmp_path / "plots" / "busbw.png", tmp_path / "out" / "comm.json"
    assert main(["comm", "--nproc", "2", "--ops", "all_reduce", "all_gather", "--min-bytes",
                 "1K", "--max-bytes", "8K", "--factor", "8", "--json", str(doc_path),
                 "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert "all_reduce: busbw GB/s" in out and not out.lstrip().startswith("{")  # the table
    assert f"plot: {plot}" in err and f"json: {doc_path}" in err
    doc = json.loads(doc_path.read_text())
    rows = {(r["op"], r["bytes"], r["algorithm"]): r for r in doc["rows"]}
    for op in ("all_reduce", "all_gather"):
        for n in (1024, 8192):
            for a in ("auto", *cost.supported(op, 2)):
                r = rows[(op, n, a)]
                assert r["time_s"] > 0 and r["iters"] >= 5  # --repeats 5, the default
                assert r["busbw_GBps"] == pytest.approx(
                    cost.bus_bandwidth(op, n, 2, r["time_s"]) / 1e9)
                assert r["predicted_s"] > 0
            assert rows[(op, n, "auto")]["chosen"] in cost.supported(op, 2)
    auto = doc["acceptance"]["auto_vs_best_time"]
    assert set(auto) == {"all_reduce 1 KiB", "all_reduce 8 KiB", "all_gather 1 KiB",
                         "all_gather 8 KiB"}
    for where, point in auto.items():  # auto's pick was timed as a fixed algorithm too
        assert point["auto_vs_best"] > 0 and point["auto_vs_pick"] is not None
        # an algorithm of the op (which one wins is the machine's business: hierarchical,
        # timed beside auto, is one of the rivals too)
        op = where.split()[0]
        assert point["best"] == "native" or serves(point["best"], op), (where, point)
    assert doc["link"]["backend"] == "gloo" and plot.stat().st_size > 0
