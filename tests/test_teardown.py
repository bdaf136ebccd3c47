"""Leaving the process group (benchmarks/teardown.py, also tests/dist.py's ranks): the
objects that hold a group are freed first, then a barrier, then destroy_process_group.
Destroying the group while a DDP model's reducer or a trainer still held it let the
group's destructor run later, from the reducer's, and deadlock against the group's own
thread: a rank of dp_vs_torch_ddp.py hung at exit (issue 39)."""

from __future__ import annotations

import ast
import gc
import os
import signal
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(BENCHMARKS))
from teardown import run_then_leave  # noqa: E402


def _called(node: ast.AST) -> str | None:
    func = node.func if isinstance(node, ast.Call) else None
    return getattr(func, "attr", None) or getattr(func, "id", None)


def test_launched_benchmark_workers_leave_through_run_then_leave():
    found = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        workers = {c.args[1].id for c in calls if _called(c) == "launch_local"
                   and len(c.args) > 1 and isinstance(c.args[1], ast.Name)}
        if not workers:
            continue
        found += [f"{path.name}:{c.lineno} calls destroy_process_group; leave through "
                  "teardown.run_then_leave" for c in calls
                  if _called(c) == "destroy_process_group"]
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in workers and not any(
                    _called(c) == "run_then_leave" for c in ast.walk(fn)):
                found.append(f"{path.name}: worker {fn.name} does not leave through "
                             "teardown.run_then_leave")
    assert not found, "\n".join(found)


class _Cycle:
    def __init__(self):
        self.me = self  # freed by the garbage collector only, as a DDP model is


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_measure_objects_die_before_the_barrier_then_the_group(group, monkeypatch):
    held, seen = [], []
    barrier, destroy = dist.barrier, dist.destroy_process_group

    def measure(x: int) -> int:
        obj = _Cycle()
        held.append(weakref.ref(obj))
        return x + 1

    monkeypatch.setattr(dist, "barrier", lambda: (seen.append(("barrier", held[0]())),
                                                  barrier()))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (seen.append(("destroy", None)),
                                                                destroy()))
    gc.disable()  # only run_then_leave's own collection may free the cycle
    try:
        assert run_then_leave(measure, 1) == 2
    finally:
        gc.enable()
    assert seen == [("barrier", None), ("destroy", None)] and not dist.is_initialized()


def test_a_failure_propagates_without_a_barrier(group, monkeypatch):
    monkeypatch.setattr(dist, "barrier", lambda: pytest.fail("a barrier after a failure"))

    def measure() -> None:
        raise ValueError("measured nothing")

    with pytest.raises(ValueError, match="measured nothing"):
        run_then_leave(measure)
    assert dist.is_initialized()  # left as it is: the process is on its way out


def _crash(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # dies sending nothing, as a crash does
    time.sleep(60)  # a peer left waiting


def test_a_rank_that_dies_without_a_result_fails_the_spawn_at_once():
    from dist import run_distributed

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 killed by signal 11 without a result"):
        run_distributed(_crash, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the timeout, nor the peer's sleep
