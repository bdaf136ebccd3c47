"""How ring attention's blocks move one hop around the cp ring, for real or simulated.

The ring code (ring.py) is written once over a transport: `ranks` are the cp ranks this
process plays, and `shift(blocks)` sends blocks[i] from ranks[i] to the next rank and
returns a pending shift whose `wait()` gives what each played rank received from the
previous one. `CommTransport` plays one rank with the communicator's isend/irecv (posted
at once, so the hop overlaps whatever the caller computes before waiting; the ledger
records each message). `LocalTransport` plays all N ranks in one process and rotates the
list: the same per-block math and the same block travels, checkable on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardtrain.comm import Communicator


class CommTransport:
    """One rank of the cp group: send to rank + 1, receive from rank - 1 (mod N)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.size = comm.size
        self.ranks = [comm.rank]

    def shift(self, blocks: Sequence[torch.Tensor], tag: str) -> _Posted:
        (block,) = blocks
        block = block.contiguous()  # kept alive (and unchanged) until wait()
        got = torch.empty_like(block)
        n, r = self.size, self.comm.rank
        # Even ranks send first, odd ranks receive first. Gloo matches messages whenever
        # they are posted, but NCCL can run a rank's point-to-point ops in posting order on one
        # stream (per peer pair, or per communicator): if every rank posted its receive
        # first, each would wait for a send queued behind its neighbour's receive. With the
        # parity order a send always meets a receive posted first or second (and at N = 2,
        # where both directions share one pair, the two ranks' orders mirror each other).
        if r % 2 == 0:
            send = self.comm.isend(block, (r + 1) % n, tag=tag)
            recv = self.comm.irecv(got, (r - 1) % n, tag=tag)
        else:
            recv = self.comm.irecv(got, (r - 1) % n, tag=tag)
            send = self.comm.isend(block, (r + 1) % n, tag=tag)
        return _Posted([recv, send], [got], keep=block)


class _Posted:
    def __init__(self, works: list, got: list[torch.Tensor], keep: torch.Tensor):
        self.works, self.got, self.keep = works, got, keep

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.got


class LocalTransport:
    """All N ranks in this process: a shift is a rotation of the list (rank r receives
    rank r - 1's block)."""

    def __init__(self, size: int):
        self.size = size
        self.ranks = list(range(size))

    def shift(self, blocks: Sequence[torch.Tensor], tag: str) -> _Rotated:
        return _Rotated([blocks[(i - 1) % self.size] for i in range(self.size)])


class _Rotated:
    def __init__(self, got: list[torch.Tensor]):
        self.got = got

    def wait(self) -> list[torch.Tensor]:
        return self.got
