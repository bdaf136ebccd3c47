"""Communicator: the collectives of one process group, each call recorded in the ledger.

Parallel code calls these methods, never torch.distributed directly. A communicator over
a group of one rank (or no group at all) turns every collective into a no-op or a local
copy, so world size 1 runs the same code. Ops: sum, avg, max, min (avg is a sum followed
by a division: Gloo has no native average).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardtrain.comm.ledger import CommLedger, CommRecord, native_volume

ALGORITHMS = ("native",)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """A launched collective. `wait()` blocks until it is done, applies any finishing step
    (the division of an average), and stamps the ledger record with the elapsed time."""

    def __init__(self, work: dist.Work | None, record: CommRecord | None,
                 finish: Callable[[], None] | None = None):
        self._work, self._record, self._finish = work, record, finish
        self._start = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        if self._record is not None:
            self._record.time_s = time.perf_counter() - self._start
        self._done = True


class Communicator:
    def __init__(self, group: dist.ProcessGroup | None, *, name: str, ranks: list[int],
                 ledger: CommLedger, node_size: int = 0, algorithm: str = "native",
                 timeout_s: float = 300.0):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"comm.algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        self.group, self.name, self.ranks, self.ledger = group, name, list(ranks), ledger
        self.size = len(ranks)
        self.node_size = node_size or self.size
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.rank = self.ranks.index(dist.get_rank()) if group is not None else 0

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank} of {self.size}, {self.algorithm})"

    # ------------------------------------------------------------------ bookkeeping

    def _record(self, op: str, t: torch.Tensor, *, is_root: bool = False, tag: str = "",
                numel: int | None = None) -> CommRecord | None:
        if self.size == 1:
            return None
        numel = t.numel() if numel is None else numel
        msg = numel * t.element_size()
        sent, recv, rounds = native_volume(op, msg, self.size, is_root=is_root)
        record = CommRecord(op=op, group=self.name, algorithm=self.algorithm,
                            dtype=str(t.dtype).removeprefix("torch."), numel=numel,
                            msg_bytes=msg, sent_bytes=sent, recv_bytes=recv, rounds=rounds,
                            tag=tag)
        self.ledger.add(record)
        return record

    def _done(self, work: dist.Work | None, record: CommRecord | None, async_op: bool,
              finish: Callable[[], None] | None = None) -> Handle:
        handle = Handle(work, record, finish)
        if not async_op:
            handle.wait()
        return handle

    def _global(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    @staticmethod
    def _check_op(op: str) -> dist.ReduceOp:
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} is not one of {', '.join(_REDUCE_OPS)}")
        return _REDUCE_OPS[op]

    def _average(self, t: torch.Tensor, op: str) -> Callable[[], None] | None:
        return (lambda: t.div_(self.size)) if op == "avg" else None

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   tag: str = "") -> Handle:
        """Reduce `tensor` in place across the group; every rank gets the result."""
        reduce_op = self._check_op(op)
        record = self._record("all_reduce", tensor, tag=tag)
        if record is None:
            return self._done(None, None, async_op)
        work = dist.all_reduce(tensor, reduce_op, group=self.group, async_op=True)
        return self._done(work, record, async_op, self._average(tensor, op))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  tag: str = "") -> Handle:
        """Copy group rank `src`'s tensor into every rank's tensor."""
        record = self._record("broadcast", tensor, is_root=self.rank == src, tag=tag)
        if record is None:
            return self._done(None, None, async_op)
        work = dist.broadcast(tensor, self._global(src), group=self.group, async_op=True)
        return self._done(work, record, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *,
               async_op: bool = False, tag: str = "") -> Handle:
        """Reduce into group rank `dst`'s tensor; other ranks' tensors are scratch."""
        reduce_op = self._check_op(op)
        record = self._record("reduce", tensor, is_root=self.rank == dst, tag=tag)
        if record is None:
            return self._done(None, None, async_op)
        work = dist.reduce(tensor, self._global(dst), reduce_op, group=self.group, async_op=True)
        finish = self._average(tensor, op) if self.rank == dst else None
        return self._done(work, record, async_op, finish)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "") -> Handle:
        """output [size * n] <- the concatenation of every rank's input [n]."""
        _expect(output.numel() == input.numel() * self.size, "all_gather", self,
                f"output has {output.numel()} elements, expected {self.size} x {input.numel()}")
        record = self._record("all_gather", output, tag=tag)
        if record is None:
            output.view(-1).copy_(input.reshape(-1))
            return self._done(None, None, async_op)
        work = dist.all_gather_into_tensor(output, input.contiguous(), group=self.group,
                                           async_op=True)
        return self._done(work, record, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       async_op: bool = False, tag: str = "") -> Handle:
        """output [n] <- chunk `rank` of the reduction of every rank's input [size * n]."""
        reduce_op = self._check_op(op)
        _expect(input.numel() == output.numel() * self.size, "reduce_scatter", self,
                f"input has {input.numel()} elements, expected {self.size} x {output.numel()}")
        record = self._record("reduce_scatter", input, tag=tag)
        if record is None:
            output.view(-1).copy_(input.reshape(-1))
            return self._done(None, None, async_op)
        work = dist.reduce_scatter_tensor(output, input.contiguous(), reduce_op,
                                          group=self.group, async_op=True)
        return self._done(work, record, async_op, self._average(output, op))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               tag: str = "") -> None:
        """On `dst`, output [size * n] <- every rank's input [n]; output is ignored elsewhere."""
        is_root = self.rank == dst
        if self.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return
        self._record("gather", input, is_root=is_root, tag=tag, numel=input.numel() * self.size)
        chunks = list(output.view(self.size, -1).unbind(0)) if is_root else None
        dist.gather(input.reshape(-1).contiguous(), chunks, dst=self._global(dst), group=self.group)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                tag: str = "") -> None:
        """output [n] <- chunk `rank` of `src`'s input [size * n]."""
        is_root = self.rank == src
        if self.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return
        self._record("scatter", output, is_root=is_root, tag=tag, numel=output.numel() * self.size)
        chunks = [c.contiguous() for c in input.reshape(self.size, -1).unbind(0)] if is_root else None
        dist.scatter(output.view(-1), chunks, src=self._global(src), group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None,
                   tag: str = "") -> None:
        """Chunk j of this rank's input goes to rank j; chunk i of output comes from rank i
        (equal chunks unless splits, in elements of dim 0, are given)."""
        if self.size == 1:
            output.copy_(input)
            return
        self._record("all_to_all", input, tag=tag)
        dist.all_to_all_single(output, input.contiguous(), output_splits, input_splits,
                               group=self.group)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        self._record("send", tensor, tag=tag)
        dist.send(tensor.contiguous(), self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> None:
        self._record("recv", tensor, tag=tag)
        dist.recv(tensor, self._global(src), group=self.group)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def _expect(ok: bool, op: str, comm: Communicator, why: str) -> None:
    if not ok:
        raise ValueError(f"{op} on group {comm.name}: {why}")
