"""Spawn W Gloo processes on a free port and collect each rank's return value.

`run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in every
process (fn must be a module-level function: it is pickled) and returns the results in
rank order. A failure on any rank raises with that rank's traceback; a hang ends at
`timeout_s`. Spawns are slow (each imports torch): group several checks per call.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
from teardown import run_then_leave  # noqa: E402  (benchmarks/: the one rule for leaving)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # What the imports made is never garbage: run_then_leave's collection then looks only
    # at what fn made (milliseconds, not 0.2 s per rank).
    gc.freeze()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        # fn's objects that hold the group are freed before it is destroyed, after a barrier
        # (benchmarks/teardown.py: otherwise a rank can hang at exit); the result is sent
        # after that, so a hang in leaving is a missing result, not a silent kill.
        value = run_then_leave(fn, rank, world_size, *args)
        # Plain pickle copies tensors by value: torch's queue would pass shared-memory
        # handles, which die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _context():
    """Forkserver with torch preloaded: each rank is forked from a process that imported
    torch once (a spawn re-imports it in every rank, the slow part of a spawn), yet starts
    clean, as nothing but imports ran before the fork. torch._dynamo as launch.py preloads it:
    each rank's optimizer would import it (1.3-2 s a rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "shardtrain.train.trainer"])
    return ctx


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline, dead_since = time.monotonic() + timeout_s, {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                _check_alive(fn, procs, out, dead_since, deadline, timeout_s)
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:  # after a failure the others may wait on the failed rank: no grace
            p.join(timeout=10 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def _check_alive(fn, procs: list, out: dict, dead_since: dict, deadline: float,
                 timeout_s: float) -> None:
    """Raise now if a rank without a result died (a crash that sent nothing, such as a
    segmentation fault: its peers would otherwise wait out the timeout) over 2 s ago (a
    result put just before its exit may still be in the pipe), or if the time is up."""
    missing = [r for r in range(len(procs)) if r not in out]
    for r in missing:
        code = procs[r].exitcode
        if code is None:
            continue
        if time.monotonic() - dead_since.setdefault(r, time.monotonic()) > 2.0:
            why = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise RuntimeError(f"{fn.__name__}: rank {r} of {len(procs)} {why} without a result")
    if time.monotonic() > deadline:
        raise TimeoutError(f"{fn.__name__}: no result from ranks {missing} in {timeout_s}s")
