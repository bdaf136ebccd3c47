"""Communicator: the collectives of one process group, each call recorded in the ledger.

Parallel code calls these methods, never torch.distributed directly. Each call runs the
algorithm named for it (`algorithm=`), or the run's `comm.algorithm`, or -- for ops that
algorithm does not implement -- the backend's own (`native`); `auto` asks the cost model
(see dispatch.py). Our algorithms are plain functions over point-to-point messages
(algorithms/); the ledger records the bytes they really moved.

A communicator over a group of one rank (or no group at all) turns every collective into a
no-op or a local copy, so world size 1 runs the same code. Ops: sum, avg, max, min (avg is a
sum followed by one division). fp32, bf16 and fp16 travel in their own dtype; each
reduction step computes in fp32 and rounds once (torch's CPU kernels; NCCL does the same).
Inputs may be non-contiguous (the result is copied back) and of any element count. On
Gloo every wait honours `timeout_s` (comm.timeout_s): a peer that never answers ends in a
CommError naming the group, the op and the algorithm. On NCCL no wait blocks the host: the
current CUDA stream waits, and the process group's own timeout (the same comm.timeout_s,
given to init_process_group and new_group) and the NCCL watchdog catch a silent peer.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm.lane import Handle, wait_native
from shardtrain.comm.p2p import Team
from shardtrain.comm.runner import REDUCE_OPS, GroupRunner, flat_view, then


class Communicator(GroupRunner):
    """The collectives of one group (constructor: see GroupRunner)."""

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   tag: str = "", algorithm: str | None = None, compress=None) -> Handle:
        """Reduce `tensor` in place across the group; every rank gets the result. With
        `compress` (see compress.py) the gradient travels compressed (op sum or avg)."""
        self._check_op(op)
        if self.size == 1:
            return _finished()
        if compress is not None:
            return Handle(future=self._lane.run(
                lambda: compress.all_reduce(self, tensor, op, tag), async_op=async_op))
        flat, back = flat_view(tensor)
        name = self._choose("all_reduce", flat, algorithm)
        return self._launch(
            "all_reduce", name, self._record("all_reduce", flat, name, tag), async_op=async_op,
            agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=op),
            native=lambda: dist.all_reduce(flat, REDUCE_OPS[op], group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["all_reduce"](team, flat, op),
            finish=then(self._average(flat, op), back))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  tag: str = "", algorithm: str | None = None) -> Handle:
        """Copy group rank `src`'s tensor into every rank's tensor."""
        if self.size == 1:
            return _finished()
        flat, back = flat_view(tensor)
        name = self._choose("broadcast", flat, algorithm)
        return self._launch(
            "broadcast", name, self._record("broadcast", flat, name, tag, root=src),
            async_op=async_op, agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=""),
            native=lambda: dist.broadcast(flat, self.ranks[src], group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["broadcast"](team.rotated(src), flat),
            finish=back)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *,
               async_op: bool = False, tag: str = "", algorithm: str | None = None) -> Handle:
        """Reduce into group rank `dst`'s tensor; other ranks' tensors are scratch."""
        self._check_op(op)
        if self.size == 1:
            return _finished()
        flat, back = flat_view(tensor)
        name = self._choose("reduce", flat, algorithm)
        root = self.rank == dst
        return self._launch(
            "reduce", name, self._record("reduce", flat, name, tag, root=dst),
            async_op=async_op, agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=op),
            native=lambda: dist.reduce(flat, self.ranks[dst], REDUCE_OPS[op], group=self.group,
                                       async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["reduce"](team.rotated(dst), flat, op),
            finish=then(self._average(flat, op) if root else None, back))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "", algorithm: str | None = None) -> Handle:
        """output [size * n] <- the concatenation of every rank's input [n]."""
        m = input.numel()
        self._expect(output.numel() == m * self.size, "all_gather",
                     f"output has {output.numel()} elements, expected {self.size} x {m}")
        out, back = flat_view(output)
        if self.size == 1:
            out.copy_(input.reshape(-1))
            return _finished(back)
        name = self._choose("all_gather", out, algorithm)
        inp = input.reshape(-1)

        def body(team: Team) -> None:
            out[self.rank * m:(self.rank + 1) * m].copy_(inp)
            IMPLEMENTATIONS[name]["all_gather"](team, out, _equal(m, self.size))

        return self._launch(
            "all_gather", name, self._record("all_gather", out, name, tag), async_op=async_op,
            agree=dict(numel=m, dtype=out.dtype, reduce_op=""),
            native=lambda: dist.all_gather_single(out, inp.contiguous(), group=self.group,
                                                 async_op=True),
            body=body, finish=back)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       async_op: bool = False, tag: str = "",
                       algorithm: str | None = None) -> Handle:
        """output [n] <- chunk `rank` of the reduction of every rank's input [size * n]."""
        self._check_op(op)
        self._expect(input.numel() == output.numel() * self.size, "reduce_scatter",
                     f"input has {input.numel()} elements, expected {self.size} x {output.numel()}")
        out, back = flat_view(output)
        if self.size == 1:
            out.copy_(input.reshape(-1))
            return _finished(back)
        inp = input.reshape(-1)
        name = self._choose("reduce_scatter", inp, algorithm)

        def body(team: Team) -> None:  # the algorithms leave their input intact
            out.copy_(IMPLEMENTATIONS[name]["reduce_scatter"](
                team, inp, _equal(out.numel(), self.size), op))

        return self._launch(
            "reduce_scatter", name, self._record("reduce_scatter", inp, name, tag),
            async_op=async_op, agree=dict(numel=out.numel(), dtype=out.dtype, reduce_op=op),
            native=lambda: dist.reduce_scatter_single(out, inp.contiguous(), REDUCE_OPS[op],
                                                      group=self.group, async_op=True),
            body=body, finish=then(self._average(out, op), back))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               tag: str = "", algorithm: str | None = None) -> None:
        """On `dst`, output [size * n] <- every rank's input [n]; output is ignored elsewhere."""
        m, p, root = input.numel(), self.size, self.rank == dst
        if root:
            self._expect(output.numel() == m * p, "gather",
                         f"output has {output.numel()} elements, expected {p} x {m}")
        if p == 1:
            output.view(-1).copy_(input.reshape(-1))
            return
        inp = input.reshape(-1).contiguous()
        name = self._choose("gather", inp, algorithm, numel=m * p)
        # Our algorithms gather in team order (root first): rotated by dst from rank order.
        direct = root and output.is_contiguous() and (name == "native" or dst == 0)
        work = output.view(-1) if direct else \
            self._scratch.get("rooted", m * p, inp.dtype, self.device) \
            if root or name != "native" else None

        def native() -> dist.Work:
            chunks = list(work.view(p, m).unbind(0)) if root else None
            return dist.gather(inp, chunks, dst=self.ranks[dst], group=self.group, async_op=True)

        def body(team: Team) -> None:
            me = (self.rank - dst) % p
            work[me * m:(me + 1) * m].copy_(inp)
            IMPLEMENTATIONS[name]["gather"](team.rotated(dst), work, _equal(m, p))

        def finish() -> None:
            if root and not direct:
                shift = 0 if name == "native" else dst
                _rotate_into(output.view(p, m), work.view(p, m), shift)

        self._launch("gather", name, self._record("gather", inp, name, tag, root=dst,
                                                  numel=m * p),
                     async_op=False, agree=dict(numel=m, dtype=inp.dtype, reduce_op=""),
                     native=native, body=body, finish=finish)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                tag: str = "", algorithm: str | None = None) -> None:
        """output [n] <- chunk `rank` of `src`'s input [size * n]."""
        m, p, root = output.numel(), self.size, self.rank == src
        if p == 1:
            output.view(-1).copy_(input.reshape(-1))
            return
        out, back = flat_view(output)
        name = self._choose("scatter", out, algorithm, numel=m * p)
        if root:
            self._expect(input.numel() == m * p, "scatter",
                         f"input has {input.numel()} elements, expected {p} x {m}")
            flat_in = input.reshape(-1).contiguous()

        def native() -> dist.Work:
            chunks = list(flat_in.view(p, m).unbind(0)) if root else None
            return dist.scatter(out, chunks, src=self.ranks[src], group=self.group, async_op=True)

        def body(team: Team) -> None:
            # In team order (root first): the root's input rotated by src.
            work = flat_in if root and src == 0 else \
                self._scratch.get("rooted", m * p, out.dtype, self.device)
            if root and src:
                _rotate_into(work.view(p, m), flat_in.view(p, m), -src)
            IMPLEMENTATIONS[name]["scatter"](team.rotated(src), work, _equal(m, p))
            me = (self.rank - src) % p
            out.copy_(work[me * m:(me + 1) * m])

        self._launch("scatter", name, self._record("scatter", out, name, tag, root=src,
                                                   numel=m * p),
                     async_op=False, agree=dict(numel=m, dtype=out.dtype, reduce_op=""),
                     native=native, body=body, finish=back)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None,
                   tag: str = "", algorithm: str | None = None) -> None:
        """Chunk j of this rank's input goes to rank j; chunk i of output comes from rank i
        (equal chunks unless splits, in elements of dim 0, are given)."""
        if self.size == 1:
            output.copy_(input)
            return
        out, back = flat_view(output)
        inp = input.reshape(-1).contiguous()
        in_rows = input_splits or [input.shape[0] // self.size] * self.size
        out_rows = output_splits or [output.shape[0] // self.size] * self.size
        row = inp.numel() // max(1, input.shape[0]) if input.dim() else 1
        equal = len(set(in_rows)) == 1 and in_rows == out_rows
        name = self._choose("all_to_all", inp, algorithm, equal_splits=equal)
        self._launch(
            "all_to_all", name, self._record("all_to_all", inp, name, tag), async_op=False,
            agree=dict(numel=0, dtype=inp.dtype, reduce_op=""), splits=(out_rows, in_rows),
            native=lambda: dist.all_to_all_single(out.view(output.shape), inp.view(input.shape),
                                                  output_splits, input_splits,
                                                  group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["all_to_all"](
                team, out, inp, _offsets(out_rows, row), _offsets(in_rows, row)),
            finish=back)

    def composite(self, job: Callable[[], None], *, async_op: bool = False) -> Handle:
        """Run `job`, a collective composed of this communicator's own ops (ZeRO++'s
        quantized all-gather and reduce-scatter), in issue order on the lane like any call;
        its inner ops land in the ledger one by one."""
        handle = Handle(future=self._lane.run(job, async_op=async_op))
        if not async_op:
            handle.wait()
        return handle

    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        self._record("send", tensor, "native", tag)
        work = dist.isend(tensor.contiguous(), group=self.group, group_dst=dst)
        wait_native(work, f"send to group rank {dst} on group {self.name}", self.timeout_s,
                    streamed=self.streamed)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> None:
        self._record("recv", tensor, "native", tag)
        work = dist.irecv(tensor, group=self.group, group_src=src)
        wait_native(work, f"recv from group rank {src} on group {self.name}", self.timeout_s,
                    streamed=self.streamed)

    def exchange(self, sends: list[tuple[int, torch.Tensor, str]],
                 recvs: list[tuple[int, torch.Tensor, str]]) -> None:
        """Point-to-point transfers posted together (batch_isend_irecv), then all waited for;
        each is (peer group rank, tensor, tag). A rank that sends and receives at the same
        time needs this: with blocking send-then-receive it and a peer doing the same would
        wait for each other. Messages between two ranks match in posting order per tag (the
        tag also labels the ledger record), so different kinds of message cannot cross."""
        ops, what = [], []
        for peer, tensor, tag in sends:
            self._record("send", tensor, "native", tag)
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group=self.group,
                                  group_peer=peer, tag=_message_tag(tag)))
            what.append(f"send ({tag}) to group rank {peer} on group {self.name}")
        for peer, tensor, tag in recvs:
            self._record("recv", tensor, "native", tag)
            ops.append(dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=peer,
                                  tag=_message_tag(tag)))
            what.append(f"recv ({tag}) from group rank {peer} on group {self.name}")
        if ops:
            for work, where in zip(dist.batch_isend_irecv(ops), what):
                wait_native(work, where, self.timeout_s, streamed=self.streamed)

    def barrier(self) -> None:
        if self.size > 1:
            work = dist.barrier(group=self.group, async_op=True)
            wait_native(work, f"barrier on group {self.name}", self.timeout_s,
                        streamed=self.streamed)


def _rotate_into(dst: torch.Tensor, src: torch.Tensor, shift: int) -> None:
    """dst[(j + shift) % p] = src[j] for the p rows, without a temporary."""
    p = src.shape[0]
    shift %= p
    dst[shift:] = src[:p - shift]
    dst[:shift] = src[p - shift:]


def _message_tag(tag: str) -> int:
    """The integer tag of a point-to-point message: from its label, kept apart (high bit)
    from the tags our collective algorithms use (runner.py)."""
    return 0x8000 | (zlib.crc32(tag.encode()) & 0x7FFF)


def _equal(m: int, p: int) -> list[int]:
    return [i * m for i in range(p + 1)]


def _offsets(rows: list[int], row: int) -> list[int]:
    out = [0]
    for r in rows:
        out.append(out[-1] + r * row)
    return out


def _finished(back: Callable[[], None] | None = None) -> Handle:
    if back is not None:
        back()
    return Handle()
