"""Ranks as threads of one process: the project's point-to-point algorithms (comm/algorithms)
and tensor-parallel layers run unchanged on Teams whose messages travel through in-memory
queues, so a worked example needs no process spawn (tests/test_seed_examples.py)."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import defaultdict

import torch

from shardtrain.comm.algorithms import ring
from shardtrain.comm.p2p import Team


class Teams:
    """`size` Teams whose messages travel through queues between threads of this process,
    matched per (sender, receiver) in posting order as Gloo matches them: the project's
    algorithms run unchanged on them."""

    def __init__(self, size: int):
        self.size, self.lock = size, threading.Lock()
        self.boxes: dict = defaultdict(queue.Queue)
        self.sent: dict = defaultdict(int)
        self.wanted: dict = defaultdict(int)

    def team(self, rank: int) -> Team:
        return QueueTeam(group=None, where="test", timeout_s=10, node_of=(0,) * self.size,
                          members=tuple(range(self.size)), index=rank, buffers={},
                          device=torch.device("cpu"), net=self)

    def run(self, fn, inputs: list) -> list:
        """fn(team, input) on every rank at once; the results in rank order."""
        out: list = [None] * self.size
        errors: list = []

        def body(rank: int) -> None:
            try:
                out[rank] = fn(self.team(rank), inputs[rank])
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        if errors:
            raise errors[0]
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class QueueTeam(Team):
    net: Teams | None = None

    def post(self, sends, recvs):
        me, net = self.members[self.index], self.net
        with net.lock:
            for i, t in sends:
                if t.numel():
                    key = (me, self.members[i])
                    net.boxes[key + (net.sent[key],)].put(t.clone())
                    net.sent[key] += 1
            pending = []
            for i, t in recvs:
                if t.numel():
                    key = (self.members[i], me)
                    pending.append((net.boxes[key + (net.wanted[key],)], t))
                    net.wanted[key] += 1
        return pending

    def wait(self, pending):
        for box, t in pending:
            t.copy_(box.get(timeout=10))


class TpComm:
    """The slice of a Communicator the tensor-parallel layers call, over a `QueueTeam`."""

    name = "tp"

    def __init__(self, team: Team):
        self.team, self.size, self.rank = team, team.size, team.index

    def all_reduce(self, x: torch.Tensor, op: str, tag: str = "") -> None:
        ring.all_reduce(self.team, x.view(-1), op)
