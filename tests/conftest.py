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


def pytest_addoption(parser) -> None:
    # Here, not in tests/gpu/conftest.py: pytest reads options only from the conftests it
    # loads first, and a run of the whole suite loads tests/gpu's later.
    parser.addoption("--device", default="auto", choices=("auto", "cpu", "cuda"),
                     help="where tests/gpu runs: cuda, or cpu (its CPU twins: the same code "
                          "paths at tiny size); auto (default): cuda where a GPU is visible")


def pytest_configure(config) -> None:
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is visible here; use "
                                "--device cpu (tests/gpu's CPU twins) or leave it out")


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


@pytest.fixture(scope="session", autouse=True)
def runtime_base(tmp_path_factory):
    """The CPU dry run's runtime base (train/start/calibrate.py `runtime_base`) stored for
    the session, in-process CLI runs reading it: otherwise the first dry run would measure it
    in a fresh process (about 10 s) and store it in the user's cache. The figure is this
    process's resident set now, what its runtime holds: tests compare it with nothing."""
    from shardtrain.cost import calibration
    from shardtrain.train.observe.metrics import _proc_status

    path = tmp_path_factory.mktemp("runtime") / "cpu_runtime.json"
    calibration.save_runtime(calibration.RuntimeBase(
        bytes=_proc_status("VmRSS") or 0, torch=torch.__version__, measured_at="this session"),
        path)
    patch = pytest.MonkeyPatch()
    patch.setattr(calibration, "RUNTIME_PATH", path)
    yield path
    patch.undo()
