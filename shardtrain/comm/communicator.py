"""Communicator: the collectives of one process group, each call recorded in the ledger.

This is the public layer: parallel code calls these methods, never torch.distributed
directly. What it adds to the layers below: the op's contract (argument checks, flat views
of non-contiguous inputs, the division of an average, world size 1 as a no-op) and the
ledger record of every call; dispatch.py picks the algorithm and runs it, p2p.py carries
our algorithms' messages, rooted.py holds gather and scatter.

Each call runs the algorithm named for it (`algorithm=`), or the run's `comm.algorithm`,
or -- for ops that algorithm does not implement -- the backend's own (`native`); `auto`
asks the cost model (see dispatch.py). Our algorithms are plain functions over
point-to-point messages (algorithms/); the ledger records the bytes they really moved.

A communicator over a group of one rank (or no group at all) turns every collective into a
no-op or a local copy, so world size 1 runs the same code. Ops: sum, avg, max, min (avg is a
sum followed by one division). fp32, bf16 and fp16 travel in their own dtype; each
reduction step computes in fp32 and rounds once (torch's CPU kernels; NCCL does the same).
Inputs may be non-contiguous (the result is copied back) and of any element count. On
Gloo every wait honours `timeout_s` (comm.timeout_s): a peer that never answers ends in a
CommTimeout naming the group, the op and the algorithm. On NCCL no wait blocks the host:
the current CUDA stream waits. Either way the hang watchdog (watchdog.py, over the flight
recorder's entries: flight.py) names the ranks that never arrived and ends every rank."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm import rooted
from shardtrain.comm.dispatch import (ALGORITHMS, CHECKS, PRICED, Handle, agreed_link,
                                      choose_for, on_device, on_grid, placed, run)
from shardtrain.comm.lane import Lane
from shardtrain.comm.ledger import CommLedger, CommRecord, add_record
from shardtrain.comm.p2p import Team, flat_view, offsets, then, wait_native
from shardtrain.comm.peer import PeerOps
from shardtrain.cost.link import Link

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# The flat-tensor all-gather and reduce-scatter: `*_single` where torch has them (2.13 calls
# the older names deprecated), else `all_gather_into_tensor` / `reduce_scatter_tensor`
# (torch 2.11, on the GPU machines). Same arguments, same work.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def payload_backend(group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that carries `device`'s tensors in `group`: a mesh group on CUDA is
    "cpu:gloo,cuda:nccl" (mesh.py), whose CUDA payload is NCCL's; else the group's one."""
    name = str(dist.get_backend(group))
    backends = dict(pair.split(":") for pair in name.split(",")) if ":" in name else {}
    return backends.get(device.type, name)


class Communicator(PeerOps):
    """The collectives of one group, each recorded in the ledger (point-to-point: peer.py)."""

    def __init__(self, group: dist.ProcessGroup | None, *, name: str, ranks: list[int],
                 ledger: CommLedger, node_size: int = 0, algorithm: str = "native",
                 timeout_s: float = 300.0, link: Link | None = None,
                 check_sizes: str = "first", device: torch.device | str = "cpu",
                 meta: dist.ProcessGroup | None = None):
        """`ranks`: the group's global ranks; `node_size`: ranks per (virtual) node, nodes
        being runs of consecutive global ranks (0: one node); `link`: the alpha-beta-gamma
        figures `auto` and the hierarchical phases price with (cost.hardware.runtime_link;
        agreed from group rank 0 where the algorithm prices); `check_sizes`: compare sizes
        across ranks before the first call of each op ("first"), every call ("all") or never
        ("off"); `device`: where the group's payload lives; `meta`: the group the CPU metadata
        travels on (None: `group` itself: a Gloo group, or a mesh group on CUDA, whose CPU
        tensors go to its Gloo backend: mesh.py)."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"comm.algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        on_device(algorithm, torch.device(device), name)
        if check_sizes not in CHECKS:
            raise ValueError(f"check_sizes={check_sizes!r} is not one of {', '.join(CHECKS)}")
        self.group, self.name, self.ranks, self.ledger = group, name, list(ranks), ledger
        self.device, self.meta = torch.device(device), meta if meta is not None else group
        self.size = len(ranks)
        self.node_size = node_size or self.size
        self.nodes = [g // node_size for g in self.ranks] if node_size else [0] * self.size
        counts = {self.nodes.count(n) for n in self.nodes}
        self.local_size = self.nodes.count(self.nodes[0]) if len(counts) == 1 else 0
        on_grid(algorithm, self.size, self.local_size, name)
        self.algorithm, self.timeout_s, self.check_sizes = algorithm, timeout_s, check_sizes
        self.rank = self.ranks.index(dist.get_rank()) if group is not None else 0
        # Communicators sharing a process group (dp and dp_cp may both be WORLD) use their
        # own message tag, so their point-to-point messages never match each other's.
        self.tag = zlib.crc32(name.encode()) & 0x7FFF
        # NCCL: every wait is a stream wait and no lane thread runs (dispatch.py).
        self.streamed = group is not None and payload_backend(group, self.device) == "nccl"
        self.lane = Lane(name, threaded=not self.streamed)
        self.buffers: dict = {}  # (device, key) -> work buffer: p2p.scratch
        self.checked: set[str] = set()  # ops whose sizes were compared (dispatch.check_due)
        self.link = link
        if self.size > 1 and algorithm in PRICED:
            self.link = agreed_link(self)

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank} of {self.size}, {self.algorithm})"

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   tag: str = "", algorithm: str | None = None, compress=None) -> Handle:
        """Reduce `tensor` in place across the group; every rank gets the result. With
        `compress` (see compress.py) the gradient travels compressed (op sum or avg)."""
        placed(self, "all_reduce", tensor)
        self._check_op(op)
        if self.size == 1:
            return _finished()
        if compress is not None:
            return Handle(future=self.lane.run(
                lambda: compress.all_reduce(self, tensor, op, tag), async_op=async_op))
        flat, back = flat_view(tensor)
        name = choose_for(self, "all_reduce", flat, algorithm)
        return run(self, 
            "all_reduce", name, self.record("all_reduce", flat, name, tag), async_op=async_op,
            agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=op),
            native=lambda: dist.all_reduce(flat, REDUCE_OPS[op], group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["all_reduce"](team, flat, op),
            finish=then(self._average(flat, op), back))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  tag: str = "", algorithm: str | None = None) -> Handle:
        """Copy group rank `src`'s tensor into every rank's tensor."""
        placed(self, "broadcast", tensor)
        if self.size == 1:
            return _finished()
        flat, back = flat_view(tensor)
        name = choose_for(self, "broadcast", flat, algorithm)
        return run(self, 
            "broadcast", name, self.record("broadcast", flat, name, tag, root=src),
            async_op=async_op, agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=""),
            native=lambda: dist.broadcast(flat, self.ranks[src], group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["broadcast"](team.rotated(src), flat),
            finish=back)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *,
               async_op: bool = False, tag: str = "", algorithm: str | None = None) -> Handle:
        """Reduce into group rank `dst`'s tensor; other ranks' tensors are scratch."""
        placed(self, "reduce", tensor)
        self._check_op(op)
        if self.size == 1:
            return _finished()
        flat, back = flat_view(tensor)
        name = choose_for(self, "reduce", flat, algorithm)
        root = self.rank == dst
        return run(self, 
            "reduce", name, self.record("reduce", flat, name, tag, root=dst),
            async_op=async_op, agree=dict(numel=flat.numel(), dtype=flat.dtype, reduce_op=op),
            native=lambda: dist.reduce(flat, self.ranks[dst], REDUCE_OPS[op], group=self.group,
                                       async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["reduce"](team.rotated(dst), flat, op),
            finish=then(self._average(flat, op) if root else None, back))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "", algorithm: str | None = None) -> Handle:
        """output [size * n] <- the concatenation of every rank's input [n]."""
        placed(self, "all_gather", output, input)
        m = input.numel()
        self.expect(output.numel() == m * self.size, "all_gather",
                     f"output has {output.numel()} elements, expected {self.size} x {m}")
        out, back = flat_view(output)
        if self.size == 1:
            out.copy_(input.reshape(-1))
            return _finished(back)
        name = choose_for(self, "all_gather", out, algorithm)
        inp = input.reshape(-1)

        def body(team: Team) -> None:
            out[self.rank * m:(self.rank + 1) * m].copy_(inp)
            IMPLEMENTATIONS[name]["all_gather"](team, out, offsets([m] * self.size, 1))

        return run(self, 
            "all_gather", name, self.record("all_gather", out, name, tag), async_op=async_op,
            agree=dict(numel=m, dtype=out.dtype, reduce_op=""),
            native=lambda: _ALL_GATHER(out, inp.contiguous(), group=self.group, async_op=True),
            body=body, finish=back)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       async_op: bool = False, tag: str = "",
                       algorithm: str | None = None) -> Handle:
        """output [n] <- chunk `rank` of the reduction of every rank's input [size * n]."""
        placed(self, "reduce_scatter", output, input)
        self._check_op(op)
        self.expect(input.numel() == output.numel() * self.size, "reduce_scatter",
                     f"input has {input.numel()} elements, expected {self.size} x {output.numel()}")
        out, back = flat_view(output)
        if self.size == 1:
            out.copy_(input.reshape(-1))
            return _finished(back)
        inp = input.reshape(-1)
        name = choose_for(self, "reduce_scatter", inp, algorithm)

        def body(team: Team) -> None:  # the algorithms leave their input intact
            out.copy_(IMPLEMENTATIONS[name]["reduce_scatter"](
                team, inp, offsets([out.numel()] * self.size, 1), op))

        return run(self, 
            "reduce_scatter", name, self.record("reduce_scatter", inp, name, tag),
            async_op=async_op, agree=dict(numel=out.numel(), dtype=out.dtype, reduce_op=op),
            native=lambda: _REDUCE_SCATTER(out, inp.contiguous(), REDUCE_OPS[op],
                                           group=self.group, async_op=True),
            body=body, finish=then(self._average(out, op), back))

    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               tag: str = "", algorithm: str | None = None) -> None:
        """On `dst`, output [size * n] <- every rank's input [n]; output is ignored elsewhere."""
        placed(self, "gather", output, input)
        rooted.gather(self, output, input, dst, tag=tag, algorithm=algorithm)

    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                tag: str = "", algorithm: str | None = None) -> None:
        """output [n] <- chunk `rank` of `src`'s input [size * n]."""
        placed(self, "scatter", output, input)
        rooted.scatter(self, output, input, src, tag=tag, algorithm=algorithm)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None,
                   tag: str = "", algorithm: str | None = None) -> None:
        """Chunk j of this rank's input goes to rank j; chunk i of output comes from rank i
        (equal chunks unless splits, in elements of dim 0, are given)."""
        placed(self, "all_to_all", output, input)
        if self.size == 1:
            output.copy_(input)
            return
        out, back = flat_view(output)
        inp = input.reshape(-1).contiguous()
        in_rows = input_splits or [input.shape[0] // self.size] * self.size
        out_rows = output_splits or [output.shape[0] // self.size] * self.size
        row = inp.numel() // max(1, input.shape[0]) if input.dim() else 1
        equal = len(set(in_rows)) == 1 and in_rows == out_rows
        name = choose_for(self, "all_to_all", inp, algorithm, equal_splits=equal)
        run(self, "all_to_all", name, self.record("all_to_all", inp, name, tag), async_op=False,
            agree=dict(numel=0, dtype=inp.dtype, reduce_op=""), splits=(out_rows, in_rows),
            native=lambda: dist.all_to_all_single(out.view(output.shape), inp.view(input.shape),
                                                  output_splits, input_splits,
                                                  group=self.group, async_op=True),
            body=lambda team: IMPLEMENTATIONS[name]["all_to_all"](
                team, out, inp, offsets(out_rows, row), offsets(in_rows, row)),
            finish=back)

    def composite(self, job: Callable[[], None], *, async_op: bool = False) -> Handle:
        """Run `job`, a collective composed of this communicator's own ops (ZeRO++'s
        quantized all-gather and reduce-scatter), in issue order on the lane like any call;
        its inner ops land in the ledger one by one."""
        handle = Handle(future=self.lane.run(job, async_op=async_op))
        if not async_op:
            handle.wait()
        return handle

    def barrier(self) -> None:
        if self.size > 1:
            self._wait("barrier", [(dist.barrier(group=self.group, async_op=True),
                                    f"barrier on group {self.name}")])

    def _wait(self, op: str, works: list[tuple[dist.Work, str]], peers: list[int] | None = None,
              tag: str = "") -> None:
        """Wait for backend works, the call's flight entry open meanwhile (flight.py)."""
        entry = self.ledger.flight.issue(self, op, tag=tag, peers=peers)
        for work, where in works:
            wait_native(work, where, self.timeout_s, streamed=self.streamed)
        self.ledger.flight.complete(entry)

    def record(self, op: str, t: torch.Tensor, name: str, tag: str, *, root: int | None = None,
                numel: int | None = None) -> CommRecord:
        numel = t.numel() if numel is None else numel
        return add_record(self.ledger, op=op, group=self.name, algorithm=name,
                      dtype=str(t.dtype).removeprefix("torch."), numel=numel,
                      msg_bytes=numel * t.element_size(), p=self.size,
                      is_root=self.rank == root, tag=tag)

    def _check_op(self, op: str) -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} on group {self.name} is not one of "
                             f"{', '.join(REDUCE_OPS)}")

    def _average(self, t: torch.Tensor, op: str) -> Callable[[], None] | None:
        return (lambda: t.div_(self.size)) if op == "avg" else None

    def expect(self, ok: bool, op: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{op} on group {self.name}: {why}")


def _finished(back: Callable[[], None] | None = None) -> Handle:
    if back is not None:
        back()
    return Handle()
