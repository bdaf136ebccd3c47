"""Part 5 of the GPU check (its second half): a one-rank NCCL group through every backend call
the runtime makes.

    python benchmarks/gpu/collectives.py --device cuda --rows ROWS.jsonl

One GPU cannot hold two NCCL ranks, so the multi-rank paths cannot run here; a one-rank
group still runs each call's NCCL kernel, its stream wait and its Gloo side channel. The
process group is initialised as shardtrain.launch does (device_id bound on CUDA), then a
payload group (NCCL) and a metadata group (Gloo, CPU tensors: mesh.py's `meta`) are created
over rank 0. Each call is the one comm/ makes (communicator.py, rooted.py, p2p.py,
dispatch.py's agreement checks), waited for with comm.p2p.wait_native (a stream wait on
NCCL), and its result is checked against what one rank must get. One row per call; on a CPU
(`--device cpu`) the payload group is Gloo, the twin.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness import error_line, part_main
from shardtrain.comm.communicator import _ALL_GATHER, _REDUCE_SCATTER  # the runtime's picks
from shardtrain.comm.p2p import post_messages, wait_native

TIMEOUT_S = 60.0


def _init(device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The world (as launch.init_distributed joins it) and the two groups over rank 0."""
    with socket.socket() as s:  # a free port for the one-rank store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            device_id=device if cuda else None)
    return (dist.new_group([0], backend="nccl" if cuda else "gloo"),
            dist.new_group([0], backend="gloo"))


def calls(device: torch.device, group, meta) -> dict[str, Callable[[], None]]:
    """name -> a check: the call, its wait, its one-rank result."""
    streamed = device.type == "cuda"

    def wait(work, what: str) -> None:
        wait_native(work, what, TIMEOUT_S, streamed=streamed)

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(got.cpu(), want.cpu(), msg=lambda m: f"{what}: {m}")

    def x(dtype=torch.float32, n: int = 1024) -> torch.Tensor:
        return torch.arange(n, device=device).to(dtype)

    def all_reduce(op, dtype) -> None:
        t = x(dtype)
        wait(dist.all_reduce(t, op, group=group, async_op=True), "all_reduce")
        same(t, x(dtype), f"all_reduce {op}")

    def all_gather() -> None:
        out = torch.empty(1024, device=device)
        wait(_ALL_GATHER(out, x(), group=group, async_op=True), "all_gather")
        same(out, x(), "all_gather")

    def reduce_scatter(dtype) -> None:
        out = torch.empty(1024, device=device, dtype=dtype)
        wait(_REDUCE_SCATTER(out, x(dtype), dist.ReduceOp.SUM, group=group, async_op=True),
             "reduce_scatter")
        same(out, x(dtype), "reduce_scatter")

    def rooted(kind: str) -> None:  # rooted.py: lists of chunks on the root
        out, chunks = torch.empty(1024, device=device), [x()]
        work = dist.gather(x(), [out], dst=0, group=group, async_op=True) if kind == "gather" \
            else dist.scatter(out, chunks, src=0, group=group, async_op=True)
        wait(work, kind)
        same(out, x(), kind)

    def all_to_all(splits: bool, dtype) -> None:
        out = torch.empty(1024, device=device, dtype=dtype)
        s = [1024] if splits else None
        wait(dist.all_to_all_single(out, x(dtype), s, s, group=group, async_op=True),
             "all_to_all")
        same(out, x(dtype), "all_to_all")

    def to_self() -> None:  # Communicator.exchange: batched sends and receives
        got = torch.empty(1024, device=device)
        for work, what in post_messages(group, "check", [(0, x(), "self")], [(0, got, "self")]):
            wait(work, what)
        same(got, x(), "send/recv")

    def simple(fn, what: str, dtype=torch.float32) -> Callable[[], None]:
        def check() -> None:
            t = x(dtype)
            wait(fn(t), what)
            same(t, x(dtype), what)
        return check

    def metadata() -> None:  # dispatch.py: size agreement and link figures, CPU on Gloo
        figures = torch.tensor([3, 1, 4], dtype=torch.int64)
        wait_native(dist.all_reduce(figures, dist.ReduceOp.MAX, group=meta, async_op=True),
                    "metadata all_reduce", TIMEOUT_S)
        dist.broadcast(figures, 0, group=meta)
        same(figures, torch.tensor([3, 1, 4]), "metadata")

    out = {f"all_reduce {op} {dt}": (lambda op=op, dt=dt: all_reduce(getattr(
        dist.ReduceOp, op.upper()), getattr(torch, dt)))
        for op in ("sum", "max", "min") for dt in ("float32", "bfloat16")}
    out["all_reduce sum int64"] = lambda: all_reduce(dist.ReduceOp.SUM, torch.int64)
    out["broadcast"] = simple(lambda t: dist.broadcast(t, 0, group=group, async_op=True),
                              "broadcast")
    out["broadcast uint8"] = simple(lambda t: dist.broadcast(t, 0, group=group, async_op=True),
                                    "broadcast uint8", torch.uint8)
    out["reduce"] = simple(lambda t: dist.reduce(t, 0, dist.ReduceOp.SUM, group=group,
                                                 async_op=True), "reduce")
    out["all_gather"] = all_gather
    out["reduce_scatter float32"] = lambda: reduce_scatter(torch.float32)
    out["reduce_scatter bfloat16"] = lambda: reduce_scatter(torch.bfloat16)
    out["gather"] = lambda: rooted("gather")
    out["scatter"] = lambda: rooted("scatter")
    out["all_to_all"] = lambda: all_to_all(False, torch.float32)
    out["all_to_all splits int8"] = lambda: all_to_all(True, torch.int8)
    if streamed:  # Gloo has no pair to itself (the CPU suite's multi-rank tests cover it)
        out["send/recv to self"] = to_self
    out["barrier"] = lambda: wait(dist.barrier(group=group, async_op=True), "barrier")
    out["gloo metadata"] = metadata
    return out


def main() -> None:
    device, rows, _ = part_main(__doc__, "collectives")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        group, meta = _init(device)
    except Exception as e:  # noqa: BLE001 -- no group: one row says why
        rows.add(f"{backend} group", False, error_line(e))
        raise
    try:
        for name, check in calls(device, group, meta).items():
            rows.guarded(f"{backend} {name}", lambda: check() or {})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
