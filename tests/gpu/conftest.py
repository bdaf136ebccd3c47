"""tests/gpu runs on the device `--device` names (tests/conftest.py): on a GPU, the checks
at their GPU size; on a CPU (the CPU suite, or `--device cpu`), each test's CPU twin -- the
same code path at tiny size -- so that a change of any API they call fails CPU CI, not the
first GPU run. Sizes are per device in each file; nothing here skips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# benchmarks/gpu/harness.py: the one-process runs these tests and the GPU check share.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))


HERE = Path(__file__).parent


def _device_type(config) -> str:
    choice = config.getoption("--device")
    return ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device of every test here: cuda (the GPU a one-process run takes) or cpu."""
    from harness import device_of

    return device_of(_device_type(request.config))


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects (pyproject.toml)
def pytest_collection_modifyitems(config, items) -> None:
    """A test marked `slow_on_cpu` is in the slow tier when its twin runs on the CPU."""
    if _device_type(config) == "cpu":
        for item in items:
            if item.get_closest_marker("slow_on_cpu") and HERE in item.path.parents:
                item.add_marker(pytest.mark.slow)
