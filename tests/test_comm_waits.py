"""How a communicator waits, by backend: on NCCL every wait is a stream wait (`work.wait()`
with no timeout: the CUDA stream waits, not the host) and no lane thread starts; on Gloo
the host waits with comm.timeout_s and asynchronous calls overlap on the lane thread.

No NCCL here: a one-process Gloo group stands in, `get_backend` answers "nccl", and the
backend call is replaced by a fake work handle that records how it is waited on.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator


class FakeWork:
    def __init__(self, log: list, done: list):
        self.log, self.done = log, done

    def wait(self, *args):
        self.log.append(args)
        return True

    def is_completed(self) -> bool:  # a query, as the flight recorder's watchdog polls it
        return bool(self.done)

    def get_future(self):  # a finished work's future holds its result (no `exception()`:
        future = torch.futures.Future()  # deprecated, and the recorder no longer calls it)
        future.set_result(None)
        return future


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _communicator(group, monkeypatch, backend: str, log: list,
                  done: list | None = None) -> Communicator:
    monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)
    # Two "ranks" so that calls are not the world-size-1 no-op; the fake does the work.
    comm = Communicator(group, name="dp", ranks=[0, 1], ledger=CommLedger(), check_sizes="off",
                        timeout_s=7.0)

    def fake_all_reduce(t, op, group=None, async_op=False):
        t.mul_(2)  # stands for the sum over the two ranks
        return FakeWork(log, [True] if done is None else done)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    return comm


def test_nccl_waits_on_the_stream_and_starts_no_thread(group, monkeypatch):
    log: list = []
    done: list = []  # the GPU has not finished the collectives yet
    comm = _communicator(group, monkeypatch, "nccl", log, done)
    assert comm.streamed
    x = torch.ones(4)
    handles = [comm.all_reduce(x, "avg", async_op=True) for _ in range(3)]
    assert comm.lane._thread is None and log == []  # issued, nothing waited yet
    for h in handles:
        h.wait()
    assert log == [(), (), ()]  # stream waits: no timeout argument, the host never polls
    # The flight recorder keeps them pending until the works say they finished (a query).
    flight = comm.ledger.flight
    assert [e.seq for e in flight.pending.values()] == [1, 2, 3]
    assert flight.poll().seq == 1
    done.append(True)
    assert flight.poll() is None and not flight.pending
    assert [e.state for e in flight.ring] == ["completed"] * 3
    assert torch.equal(x, torch.ones(4))  # avg divided after each wait
    comm.all_reduce(x, "sum")
    assert log[-1] == () and comm.lane._thread is None
    job_ran = []
    comm.composite(lambda: job_ran.append(1), async_op=True).wait()
    assert job_ran == [1] and comm.lane._thread is None  # composites run inline too


def test_gloo_waits_on_the_host_with_the_timeout_and_overlaps_on_the_lane(group, monkeypatch):
    log: list = []
    comm = _communicator(group, monkeypatch, "gloo", log)
    assert not comm.streamed
    x = torch.ones(4)
    comm.all_reduce(x, "sum")
    assert log == [(timedelta(seconds=7.0),)]
    comm.composite(lambda: None, async_op=True).wait()
    assert comm.lane._thread is not None  # the asynchronous job ran on the lane thread


def gloo_work_states(rank: int, world_size: int) -> dict:
    """Worker: the flight recorder's `_finished` on real Gloo works: a collective that
    succeeded, one that failed (rank 0 never joins; Gloo reports it completed anyway), and
    a point-to-point message (no future: left to the host's wait)."""
    from shardtrain.comm.flight import _finished

    short = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    ok = dist.all_reduce(torch.ones(4), async_op=True)
    ok.wait()
    x = torch.ones(4)
    sent = dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)
    sent.wait()
    out = {"ok": _finished(ok), "p2p": _finished(sent)}
    if rank == 1:
        failed = dist.all_reduce(torch.ones(4), group=short, async_op=True)
        deadline = time.monotonic() + 30
        while not failed.is_completed() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["failed_completed"], out["failed"] = failed.is_completed(), _finished(failed)
    dist.barrier()  # rank 0 waits here, past rank 1's timeout
    return out


def test_the_flight_recorder_tells_failed_gloo_works_from_finished_ones():
    from dist import run_distributed

    ranks = run_distributed(gloo_work_states, 2)
    assert all(r["ok"] and not r["p2p"] for r in ranks)
    assert ranks[1]["failed_completed"] and not ranks[1]["failed"]
