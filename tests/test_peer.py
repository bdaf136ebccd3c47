"""Non-blocking point-to-point (comm/peer.py): a receive from any source names the first
sender, `done()` is false until the message is there, and the ledger records each message."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from dist import run_distributed

from shardtrain.comm import CommLedger, Communicator


def _any_source(rank: int, world_size: int) -> dict:
    ledger = CommLedger()
    comm = Communicator(dist.group.WORLD, name="world", ranks=list(range(world_size)),
                        ledger=ledger, timeout_s=60)
    out: dict = {}
    if rank == 0:
        got = []
        for _ in range(2):
            buf = torch.zeros(3)
            work = comm.irecv(buf, tag="push")
            if not got:
                out["done_before"] = work.done()
                comm.send(torch.ones(1), 2, tag="go")  # only now may rank 2 send
            got.append((work.wait(), buf.tolist()))
        out["got"] = got
        out["ledger"] = [(r.op, r.tag, r.recv_bytes) for r in ledger.records]
    else:
        if rank == 2:
            comm.recv(torch.zeros(1), 0, tag="go")
        else:
            time.sleep(1.0)  # rank 1 sends well after rank 2
        work = comm.isend(torch.full((3,), float(rank)), 0, tag="push")
        out["peer"] = work.wait()
        out["done_after"] = work.done()
    return out


def test_receive_from_any_source_names_the_first_sender():
    r0, r1, r2 = run_distributed(_any_source, 3)
    assert r0["done_before"] is False
    assert r0["got"] == [(2, [2.0] * 3), (1, [1.0] * 3)]
    assert ("recv", "push", 12) in r0["ledger"] and ("send", "go", 0) in r0["ledger"]
    assert r1 == {"peer": 0, "done_after": True} and r2 == {"peer": 0, "done_after": True}
