"""The rooted data movements, gather and scatter: Communicator.gather and .scatter.

What they add over the other collectives: our rooted algorithms work in team order, root
first (index 0), while callers and the backend work in rank order, so a call rotates the
root's buffer by the root's rank on the way in or out; and torch's own gather/scatter
take lists of per-rank chunks rather than one flat buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm.dispatch import choose_for, run
from shardtrain.comm.p2p import Team, flat_view, offsets, rotate_into, scratch


def gather(comm, output: torch.Tensor | None, input: torch.Tensor, dst: int, *, tag: str,
           algorithm: str | None) -> None:
    m, p, root = input.numel(), comm.size, comm.rank == dst
    if root:
        comm.expect(output.numel() == m * p, "gather",
                    f"output has {output.numel()} elements, expected {p} x {m}")
    if p == 1:
        output.view(-1).copy_(input.reshape(-1))
        return
    inp = input.reshape(-1).contiguous()
    name = choose_for(comm, "gather", inp, algorithm, numel=m * p)
    # Our algorithms gather in team order (root first): rotated by dst from rank order.
    direct = root and output.is_contiguous() and (name == "native" or dst == 0)
    if direct:
        work = output.view(-1)  # [p * m]
    elif root or name != "native":
        work = scratch(comm.buffers, "rooted", m * p, inp.dtype, comm.device)
    else:
        work = None

    def native() -> dist.Work:
        chunks = list(work.view(p, m).unbind(0)) if root else None
        return dist.gather(inp, chunks, dst=comm.ranks[dst], group=comm.group, async_op=True)

    def body(team: Team) -> None:
        me = (comm.rank - dst) % p
        work[me * m:(me + 1) * m].copy_(inp)
        IMPLEMENTATIONS[name]["gather"](team.rotated(dst), work, offsets([m] * p, 1))

    def finish() -> None:
        if root and not direct:
            shift = 0 if name == "native" else dst
            rotate_into(output.view(p, m), work.view(p, m), shift)

    run(comm, "gather", name, comm.record("gather", inp, name, tag, root=dst, numel=m * p),
        async_op=False, agree=dict(numel=m, dtype=inp.dtype, reduce_op=""),
        native=native, body=body, finish=finish)


def scatter(comm, output: torch.Tensor, input: torch.Tensor | None, src: int, *, tag: str,
            algorithm: str | None) -> None:
    m, p, root = output.numel(), comm.size, comm.rank == src
    if p == 1:
        output.view(-1).copy_(input.reshape(-1))
        return
    out, back = flat_view(output)
    name = choose_for(comm, "scatter", out, algorithm, numel=m * p)
    if root:
        comm.expect(input.numel() == m * p, "scatter",
                    f"input has {input.numel()} elements, expected {p} x {m}")
        flat_in = input.reshape(-1).contiguous()  # [p * m]

    def native() -> dist.Work:
        chunks = list(flat_in.view(p, m).unbind(0)) if root else None
        return dist.scatter(out, chunks, src=comm.ranks[src], group=comm.group, async_op=True)

    def body(team: Team) -> None:
        # In team order (root first): the root's input rotated by src.
        work = flat_in if root and src == 0 else \
            scratch(comm.buffers, "rooted", m * p, out.dtype, comm.device)
        if root and src:
            rotate_into(work.view(p, m), flat_in.view(p, m), -src)
        IMPLEMENTATIONS[name]["scatter"](team.rotated(src), work, offsets([m] * p, 1))
        me = (comm.rank - src) % p
        out.copy_(work[me * m:(me + 1) * m])

    run(comm, "scatter", name, comm.record("scatter", out, name, tag, root=src, numel=m * p),
        async_op=False, agree=dict(numel=m, dtype=out.dtype, reduce_op=""),
        native=native, body=body, finish=back)
