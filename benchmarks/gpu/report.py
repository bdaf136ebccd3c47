"""The GPU check's last step: its rows, the tests' results and the parts' exit codes, as one
JSON document and one markdown table.

    python benchmarks/gpu/report.py WORK OUT

WORK holds rows.jsonl (every part's rows, harness.Rows), tests.xml (pytest's JUnit report
of tests/gpu), parts.jsonl (check.sh's line per part: name, exit code, seconds, limit) and
meta.json (when, dry run or not); the device is the probe's.
Figures a test records (pytest's `record_property`) join its row. Writes OUT/check.json and OUT/check.md; exits 1 when a part failed or timed out or a row
is not ok (each is named in the table), else 0.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SKIP = ("part", "name", "ok", "error", "seconds")  # columns of their own, not figures


def test_rows(xml: Path) -> list[dict]:
    """One row per test case of pytest's JUnit report."""
    if not xml.is_file():
        return []
    rows = []
    for case in ET.parse(xml).iter("testcase"):
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        error = None
        if failed is not None:
            error = (failed.get("message") or "failed").strip().splitlines()[0][:300]
        elif skipped is not None:
            error = "skipped: " + (skipped.get("message") or "")[:200]
        found = {prop.get("name"): _number(prop.get("value")) for prop in case.iter("property")}
        rows.append({"part": "tests", "name": name, "ok": failed is None and skipped is None,
                     "error": error, **found, "seconds": float(case.get("time", 0))})
    return rows


def _number(text: str | None):
    """A test's recorded figure (pytest's record_property writes strings)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.is_file() else []


def figures(row: dict) -> str:
    """A row's figures in words: floats to 4 significant digits, lists joined."""
    out = []
    for k, v in row.items():
        if k in SKIP or v is None:
            continue
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, list):
            v = ", ".join(map(str, v)) or "none"
        out.append(f"{k} {v}")
    if (row.get("seconds") or 0) >= 0.1:
        out.append(f"{row['seconds']:.1f} s")
    return "; ".join(out).replace("|", "/")


def markdown(doc: dict) -> str:
    lines = [f"# GPU check on {doc['device']} ({doc['when']}; dry run: {doc['dry_run']})", "",
             "| part | check | result | figures |", "|---|---|---|---|"]
    for row in doc["rows"]:
        result = "ok" if row["ok"] else (row["error"] or "failed").replace("|", "/")
        lines.append(f"| {row['part']} | {row['name']} | {result} | {figures(row)} |")
    lines.append("")
    lines.append("Parts: " + ", ".join(
        f"{p['part']} exit {p['exit']} in {p['seconds']} s (limit {p['limit']} s"
        + (", TIMED OUT)" if p["exit"] in (124, 137) else ")") for p in doc["parts"]))
    lines.append(f"Result: {'PASS' if doc['passed'] else 'FAIL'} "
                 f"({sum(not r['ok'] for r in doc['rows'])} of {len(doc['rows'])} rows not ok)")
    return "\n".join(lines) + "\n"


def main(work: Path, out: Path) -> int:
    meta = json.loads((work / "meta.json").read_text()) if (work / "meta.json").is_file() else {}
    rows = read_lines(work / "rows.jsonl")
    rows = [*[r for r in rows if r["part"] == "probe"], *test_rows(work / "tests.xml"),
            *[r for r in rows if r["part"] != "probe"]]
    parts = read_lines(work / "parts.jsonl")
    passed = all(r["ok"] for r in rows) and all(p["exit"] == 0 for p in parts) and bool(rows)
    device = next((r.get("model") for r in rows if r["part"] == "probe"
                   and r["name"].startswith("device")), None) or "an unknown device"
    doc = {"device": device, "when": meta.get("when", "?"),
           "dry_run": meta.get("dry_run", False), "passed": passed, "parts": parts,
           "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "check.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
