"""The commands of README.md and docs/*.md run as written.

Every ```bash block of the README and of docs/*.md is read; its lines (continuations joined,
comments dropped, `&&` chains split) are commands. Each command is first checked to parse:
a `shardtrain train` (also under torchrun) has its config loaded and validated for its
world size, exactly as the launcher would before starting a process; every other
`shardtrain` or `benchmarks/` command has each of its options found in its own `--help`.
Then the cheap commands run, in document order, in a scratch copy of the repository root
(its entries linked, `runs/` fresh), train commands on the session's copy of the tiny
preset's stdlib text and its token cache (tests/conftest.py; the command's own
`--data.source` or `--data.max_bytes` is kept). Cheap means seconds: `--help`,
`shardtrain plan` and `shardtrain schedule`, a `--config tiny` training of at most 50 steps
on one process or at most 10 steps on two, and `generate` / `report` / `export` on what an earlier command wrote. The
rest (the default 400-step run, benchmarks, installs, larger launches) is skipped with its
reason.

To keep the whole check near a minute on a 2-core machine, the cheap commands run in one
interpreter (torch imported once) through `shardtrain.cli.main`, the function
`python -m shardtrain` calls: tests/docs_runner.py is that runner's script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import docs_runner
from docs_runner import DOCS, ROOT, Command, doc_commands

TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest"
COMMANDS = doc_commands()


# ---------------------------------------------------------------------------- the tests


def test_readme_keeps_the_ci_command_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert TEST_COMMAND in readme.splitlines()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(readme.splitlines()) < 250


def test_links_between_docs_resolve():
    """Every relative link names an existing file, and its #anchor one of that file's headings."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_docs_have_commands():
    assert len(COMMANDS) > 20
    assert any(c.argv[:2] == ("shardtrain", "train") for c in COMMANDS)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Runs every command (parse check, then the run if cheap) in one runner process."""
    work = tmp_path_factory.mktemp("docs")
    scratch = work / "repo"
    scratch.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (scratch / entry.name).symlink_to(entry)
    spec = work / "commands.json"
    spec.write_text(json.dumps([asdict(c) for c in COMMANDS]))
    out = work / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, docs_runner.__file__, str(spec), str(scratch),
                           str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text[:60]}" for c in COMMANDS])
def test_doc_command(command: Command, results):
    result = results[command.text]
    if result["status"] == "failed":
        pytest.fail(f"{command.where}: `{command.text}` {result['reason']}\n{result['output']}")
    if result["status"] == "skipped":
        pytest.skip(f"{command.where}: {result['reason']}")
