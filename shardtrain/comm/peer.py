"""Point-to-point messages: blocking `send`, `recv` and `exchange` (the pipeline's batches),
and non-blocking `isend`, and `irecv` from one peer or from any.

A parameter server must take whichever worker's push arrives first (asynchronous training:
Li et al. 2014), and a worker keeps a bounded number of pushes in flight while backward goes
on (ByteScheduler's credit: Peng et al. 2019). Both need a message posted now and waited
for, or tested, later. Each call is recorded in the ledger when posted, with the bytes of
the tensor (a receive from any source is recorded on the receiver the same way).
Messages between two ranks match in posting order per tag (as `Communicator.exchange`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtrain.comm.dispatch import placed
from shardtrain.comm.p2p import message_tag, post_messages, wait_native


class PeerWork:
    """A posted message: `wait()` returns the peer's group rank (the sender, for a receive
    from any source); `done()` tells without blocking whether it completed."""

    def __init__(self, work: dist.Work | None, peer: int | None, where: str, timeout_s: float,
                 streamed: bool = False):
        self._work, self._peer, self._where, self._timeout_s = work, peer, where, timeout_s
        self._streamed = streamed
        self._waited = work is None

    def done(self) -> bool:
        return self._waited or self._work.is_completed()

    def wait(self) -> int:
        if not self._waited:
            wait_native(self._work, self._where, self._timeout_s, streamed=self._streamed)
            self._waited = True
        if self._peer is None:
            self._peer = self._work._source_rank()  # the group rank of the sender
        return self._peer


class PeerOps:
    """Mixed into Communicator (uses its group, name, ledger, timeout and tag scheme): the
    blocking send, recv and exchange, and the non-blocking isend and irecv."""

    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        placed(self, "send", tensor)
        self.record("send", tensor, "native", tag)
        self._wait("send", [(dist.isend(tensor.contiguous(), group=self.group, group_dst=dst),
                             f"send to group rank {dst} on group {self.name}")], [dst], tag)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> None:
        placed(self, "recv", tensor)
        self.record("recv", tensor, "native", tag)
        self._wait("recv", [(dist.irecv(tensor, group=self.group, group_src=src),
                             f"recv from group rank {src} on group {self.name}")], [src], tag)

    def exchange(self, sends: list[tuple[int, torch.Tensor, str]],
                 recvs: list[tuple[int, torch.Tensor, str]]) -> None:
        """Point-to-point transfers posted together (batch_isend_irecv), then all waited for;
        each is (peer group rank, tensor, tag). A rank that sends and receives at the same
        time needs this: with blocking send-then-receive it and a peer doing the same would
        wait for each other. Messages between two ranks match in posting order per tag (the
        tag also labels the ledger record), so different kinds of message cannot cross."""
        for op, messages in (("send", sends), ("recv", recvs)):
            for peer, tensor, tag in messages:
                placed(self, "exchange", tensor)
                self.record(op, tensor, "native", tag)
        self._wait("exchange", post_messages(self.group, self.name, sends, recvs),
                   sorted({peer for peer, _, _ in sends + recvs}))

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> PeerWork:
        """Post a send of `tensor` (kept alive and unchanged until the work is done)."""
        placed(self, "isend", tensor)
        self.record("send", tensor, "native", tag)
        work = dist.isend(tensor, group=self.group, group_dst=dst, tag=message_tag(tag))
        return PeerWork(work, dst, f"send ({tag}) to group rank {dst} on group {self.name}",
                        self.timeout_s, self.streamed)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, *,
              tag: str = "") -> PeerWork:
        """Post a receive into `tensor` (contiguous) from group rank `src`, or from any rank
        of the group when `src` is None; `wait()` then names the sender."""
        placed(self, "irecv", tensor)
        self.record("recv", tensor, "native", tag)
        if src is None:
            work = self.group.recv_anysource([tensor], message_tag(tag))
        else:
            work = dist.irecv(tensor, group=self.group, group_src=src, tag=message_tag(tag))
        who = "any rank" if src is None else f"group rank {src}"
        return PeerWork(work, src, f"recv ({tag}) from {who} on group {self.name}",
                        self.timeout_s, self.streamed)
