"""benchmarks/gpu/check.sh, the GPU check (docs/performance.md): its dry run -- the whole
script on the CPU, each part its CPU twin -- passes without the packages the GPU machines
lack (`datasets`, and the trackers), from the source tree; and its report names every row
that failed and every part that failed or ran out of time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import report  # noqa: E402

PARTS = ["probe", "collectives", "tests", "sweep", "audit", "dryrun", "mfu"]
ABSENT = ("datasets", "wandb", "trackio")  # not on the GPU machines (device KINDS.md)


def test_report_names_failures_and_timeouts(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    rows = [{"part": "probe", "name": "device cuda", "ok": True, "error": None, "model": "H100"},
            {"part": "sweep", "name": "zero3 bf16", "ok": False, "error": "ValueError: bad"},
            {"part": "sweep", "name": "lora", "ok": True, "error": None, "loss": 5.1}]
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parts = [{"part": "sweep", "exit": 1, "seconds": 3, "limit": 9},
             {"part": "mfu", "exit": 124, "seconds": 9, "limit": 9}]
    (work / "parts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in parts))
    (work / "tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="test_gpu" name="test_a[bf16]" time="1.5">'
        '<properties><property name="eval_loss" value="2.4"/></properties></testcase>'
        '<testcase classname="test_gpu" name="test_b" time="2"><failure message="assert 1 == 2'
        '"/></testcase></testsuite></testsuites>')
    assert report.main(work, out) == 1
    doc = json.loads((out / "check.json").read_text())
    assert doc["device"] == "H100" and not doc["passed"]
    assert [r["name"] for r in doc["rows"]] == ["device cuda", "test_gpu::test_a[bf16]",
                                                "test_gpu::test_b", "zero3 bf16", "lora"]
    table = (out / "check.md").read_text()
    assert "| tests | test_gpu::test_a[bf16] | ok | eval_loss 2.4; 1.5 s |" in table
    assert "| tests | test_gpu::test_b | assert 1 == 2 |" in table
    assert "| sweep | zero3 bf16 | ValueError: bad |" in table
    assert "mfu exit 124 in 9 s (limit 9 s, TIMED OUT)" in table
    assert "FAIL (2 of 5 rows not ok)" in table


@pytest.mark.slow
def test_dry_run_passes_from_the_source_tree(tmp_path):
    """~3 minutes here: every part in its own process, as on the GPU."""
    blocked = tmp_path / "blocked"  # as absent as on the GPU machines
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(blocked), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    log = (out / "log").read_text() if (out / "log").is_file() else run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert sorted(p.name for p in out.iterdir()) == ["check.json", "check.md", "log"]
    doc = json.loads((out / "check.json").read_text())
    assert doc["passed"] and doc["dry_run"] and doc["device"] == "cpu"
    assert [p["part"] for p in doc["parts"]] == PARTS
    assert all(p["exit"] == 0 for p in doc["parts"]), doc["parts"]
    assert {r["part"] for r in doc["rows"]} == set(PARTS)
    versions = next(r for r in doc["rows"] if r["name"] == "versions")
    assert all(versions[name] is None for name in ABSENT if name in versions)
    assert versions["datasets"] is None
    names = {r["name"] for r in doc["rows"] if r["part"] == "sweep"}
    assert {"ddp fp32", "zero3 nvme offload", "qlora", "compile"} <= names
