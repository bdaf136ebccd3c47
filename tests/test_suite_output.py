"""The test suite's closing line ("N passed, M skipped in Xs") is printed every time: with
the `-q` that habit, docs and CI add, and with the output in a file, as CI has it.

pytest prints no closing line at verbosity -2 (`-qq`). pyproject.toml used to carry
`addopts = "-q"`, which a command line's own -q stacked into -qq: such a run ended on the
progress line or the warnings summary with no count of passed and failed tests (issue 39).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_closing_line_is_printed_with_q_and_output_in_a_file(tmp_path):
    log = tmp_path / "pytest.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # this run's own
    # pyproject.toml's options apply; --noconftest spares conftest.py's torch import (5 s of
    # CPU). Whatever else eats the line in a whole run, .ci/run's check of its log says so.
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--noconftest", "tests/test_imports.py"], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text()
    assert rc == 0, text
    last = text.rstrip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s", last), f"no closing line; the output:\n{text}"
