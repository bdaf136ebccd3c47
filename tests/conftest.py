import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ helpers (dist.py, parity.py) import as top-level modules, here and in spawned workers.
sys.path.insert(0, str(Path(__file__).parent))

# One thread, as the spawned workers run (dist.py): with two, the tests' tiny models spend
# most of their kernel time in thread hand-offs (2-50x slower when the cores are busy).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory) -> None:
    """One token cache for the session's tiny runs (parity.tiny_data; here, in spawned ranks
    and in CLI subprocesses, through the environment): the text is tokenized once, not
    once per test directory."""
    from parity import CACHE_ENV

    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("token-cache"))


_SUMMARY = pytest.StashKey[list]()


@pytest.fixture
def summary(request):
    """`summary(line)`: a line for the end of the run's output, before pytest's count (the
    lifecycle matrix's rows and the pairs they cover), shown whether the test passed or not."""
    lines = request.config.stash.setdefault(_SUMMARY, [])
    return lines.append


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_SUMMARY, [])
    if lines:
        terminalreporter.section("shardtrain")
        for line in lines:
            terminalreporter.write_line(line)
