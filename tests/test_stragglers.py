"""Stragglers (train/pace.py): per-rank compute and wait seconds in metrics.jsonl on logged
steps, a rank persistently slower than its stage peers named in a warning and in
metrics.jsonl, and `shardtrain report` showing both.

The runs inject the straggler with `train.slow_ranks` (train/observe/straggler.py). The assertions
are about who is named, never about timings. Rank 2 sleeps 29 x 3 x its forward's CPU time
per forward: if load stretches every rank's compute k-fold in wall time, rank 2's ratio to
its peers is about 1 + 29 / k, above the rule's 3x (on 3 logged steps in a row) up to
k = 14; the 4 ranks on a shared 2-core machine measure k near 2.5. Without a slow rank, 3x
on 3 steps in a row is far beyond the jitter between equal ranks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.config import ConfigError
from shardtrain.train.pace import TAG, Pace, StragglerRule
from shardtrain.train.observe.report import report
from tests.dist import run_distributed
from tests.parity import make_mesh, tiny, tiny_data

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config", "tiny", "--train.steps", "8", "--train.log_every", "1",
        "--train.global_batch", "16", "--train.progress", "false",
        "--train.straggler_factor", "3", "--train.straggler_patience", "3"]


def _train(tmp: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", "--nproc", "4", *ARGS, *extra,
         "--train.run_dir", str(run_dir), *tiny_data(tmp)],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _report(run_dir: Path) -> str:
    pytest.importorskip("matplotlib")  # the report draws the timeline too
    out = io.StringIO()
    report(run_dir, out)
    return out.getvalue()


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_slow_rank_is_named_in_warning_metrics_and_report(tmp_path):
    proc, run_dir = _train(tmp_path, "slow", "--train.slow_ranks", "2:30")
    warned = [line for line in proc.stderr.splitlines() if "is a straggler" in line]
    assert warned and all(line.startswith("warning: rank 2 is a straggler") for line in warned), \
        proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:  # every step is logged here (log_every 1): every rank's figures
        assert len(r["rank_compute_s"]) == len(r["rank_wait_s"]) == 4
        assert r["compute_s"] == pytest.approx(r["rank_compute_s"][0], rel=1e-6)  # fp32 travel
        assert r["wait_s"] >= 0
        assert set(r["stragglers"]) <= {2}, r["stragglers"]
    # named once patience (3 logged steps) allows, and still named at the end
    assert records[-1]["stragglers"] == [2]
    assert any("rank 2 is a straggler" in w for r in records
               for w in r.get("straggler_warnings", []))
    text = _report(run_dir)
    assert "per-rank compute and wait" in text and "stragglers: rank 2\n" in text, text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("per-rank compute"))
    assert lines[at + 1].split() == ["rank", "compute", "s", "wait", "s"]
    assert [line.split()[0] for line in lines[at + 2:at + 6]] == ["0", "1", "2", "3"], text


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_run_without_slow_ranks_names_nobody(tmp_path):
    proc, run_dir = _train(tmp_path, "even")
    assert "straggler" not in proc.stderr, proc.stderr[-3000:]
    records = _records(run_dir)
    assert all(r["stragglers"] == [] and "straggler_warnings" not in r for r in records)
    text = _report(run_dir)
    assert "stragglers: none named" in text
    # Data parallel only: no pipeline drawn, no "1f1b schedule, p=1" nor its bubble.
    assert "no pipeline (parallel.pp=1, 4 rank(s))" in text and "bubble fraction" not in text
    assert not (run_dir / "timeline.png").exists()


def test_rule_needs_patience_and_compares_within_a_stage():
    # ranks 0, 1 are stage 0; ranks 2, 3 stage 1 (which may be slower: other work)
    rule = StragglerRule(factor=1.5, patience=2, stages=[0, 0, 1, 1])
    assert rule.update([1.0, 1.0, 5.0, 5.0]) == {}  # stage 1 is slower, evenly: nobody
    assert rule.update([1.0, 2.0, 1.0, 1.0]) == {}  # one step over is not persistent
    assert rule.update([1.0, 3.0, 1.0, 1.0]) == {1: 2.5}  # two in a row: named, mean ratio
    assert rule.update([1.0, 1.0, 1.0, 1.0]) == {}  # back in line: no longer named
    assert StragglerRule(factor=0, patience=1, stages=[0, 0]).update([1.0, 9.0]) == {}  # off
    assert StragglerRule(factor=1.5, patience=1, stages=[0]).update([9.0]) == {}  # no peers


@pytest.mark.parametrize("factor,patience,field", [
    ("1", "3", "train.straggler_factor"), ("-2", "3", "train.straggler_factor"),
    ("nan", "3", "train.straggler_factor"), ("1.5", "0", "train.straggler_patience")])
def test_bad_straggler_settings_are_refused(tmp_path, factor, patience, field):
    with pytest.raises(ConfigError, match=field):  # nan: refused as the value is read
        tiny(tmp_path, "bad", "--train.straggler_factor", factor,
             "--train.straggler_patience", patience).validate(1)
    tiny(tmp_path, "off", "--train.straggler_factor", "0").validate(1)  # 0: the rule is off


def _gather(rank: int, world_size: int, tmp: Path) -> dict:
    """Pace.gather over two 4-rank layouts (pp x tp, then dp x cp): every rank's row, in
    rank order, through the Communicator with the gather's own tag."""
    out = {}
    for layout in (("--parallel.pp", "2", "--parallel.tp", "2"),
                   ("--parallel.dp", "2", "--parallel.cp", "2")):
        cfg = tiny(tmp, "gather", *layout)
        mesh = make_mesh(cfg, rank, world_size)
        first = len(mesh.ledger.records)
        rows = Pace(cfg, mesh).gather([float(rank), 10.0 * rank, 0.5])
        out[layout] = {"rows": rows.tolist(),
                       "tags": {r.tag for r in mesh.ledger.records[first:]}}
    return out


def test_gather_brings_every_rank_in_rank_order_with_its_tag(tmp_path):
    for per_layout in run_distributed(_gather, 4, tmp_path):
        for got in per_layout.values():
            assert got["rows"] == [[r, 10.0 * r, 0.5] for r in range(4)]
            assert got["tags"] == {TAG}
