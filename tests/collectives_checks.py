"""The collectives' checks that run on every rank of one 8-process world (tests/
test_collectives.py asserts on what they return): every op x algorithm against the native
backend on world sizes 2-8 (a sub-group per size: spawning is the slow part), the ledger's
bytes per algorithm, and bad input on fresh two-rank groups.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator
from shardtrain.comm.algorithms import IMPLEMENTATIONS, ring
from shardtrain.comm.dispatch import on_grid
from shardtrain.comm.p2p import CommError
from shardtrain.cost.link import Link

# 2^15 + 3: a 128 KiB message that no world size divides, cut into parts of 16-64 KiB.
COUNTS = (0, 1, 7, 1000, 2**15 + 3)
REDUCE_OPS = ("sum", "avg", "max", "min")
TOPOLOGICAL = ("hierarchical", "torus2d", "mesh2d", "torus3d", "ring_tree")
GRIDS = ("mesh2d", "torus3d", "ring_tree")  # on the groups they can lay out, virtual nodes
# Ties under a pure-bandwidth link go to the first algorithm, ring: a deterministic choice
# for hierarchical's phases in the volume checks.
BANDWIDTH_LINK = Link(alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)


def _data(count: int, rank: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(count, generator=g).to(dtype)


def _same(got: torch.Tensor, ref: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(got, ref)
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    return torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)


def _algorithms(op: str, topological: bool, comm: Communicator | None = None) -> list[str]:
    """The algorithms serving `op`; GRIDS only with a `comm` they can lay out (elsewhere
    the communicator refuses them: test_bad_input_fails_clearly)."""
    return [a for a, ops in IMPLEMENTATIONS.items()
            if op in ops and (a in TOPOLOGICAL) == topological
            and (a not in GRIDS or comm is not None and _lays_out(a, comm))]


def _lays_out(algorithm: str, comm: Communicator) -> bool:
    try:
        on_grid(algorithm, comm.size, comm.local_size, comm.name)
    except ValueError:
        return False
    return True


def _check_ops(comm: Communicator, topological: bool, bad: list, grids: bool = False) -> None:
    """Every op this communicator's algorithms serve, against native, on every count;
    `grids`: GRIDS too, where they lay the group out."""
    p, r = comm.size, comm.rank
    grid_comm = comm if grids else None
    note = lambda *what: bad.append((p, comm.node_size, *what))  # noqa: E731
    for seed, n in enumerate(COUNTS):
        chunk = -(-n // p) if n > 1000 else n  # per-rank count of the gathering ops
        for op in REDUCE_OPS:
            x = _data(n, r, seed)
            ref = x.clone()
            comm.all_reduce(ref, op)
            for a in _algorithms("all_reduce", topological, grid_comm):
                y = x.clone()
                comm.all_reduce(y, op, algorithm=a)
                if not _same(y, ref, op in ("max", "min")):
                    note("all_reduce", a, op, n)
        for op in ("sum", "max"):
            x = _data(chunk * p, r, seed)
            ref = torch.empty(chunk)
            comm.reduce_scatter(ref, x, op)
            for a in _algorithms("reduce_scatter", topological, grid_comm):
                y = torch.empty(chunk)
                comm.reduce_scatter(y, x, op, algorithm=a)
                if not _same(y, ref, op == "max"):
                    note("reduce_scatter", a, op, n)
        x = _data(chunk, r, seed)
        ref = torch.empty(chunk * p)
        comm.all_gather(ref, x)
        for a in _algorithms("all_gather", topological, grid_comm):
            y = torch.full((chunk * p,), float("nan"))
            comm.all_gather(y, x, algorithm=a)
            if not torch.equal(y, ref):
                note("all_gather", a, n)
        if topological:
            continue
        for root in {0, p - 1}:
            x = _data(n, r, seed)
            ref = x.clone()
            comm.broadcast(ref, root)
            for a in _algorithms("broadcast", False):
                y = x.clone()
                comm.broadcast(y, root, algorithm=a)
                if not torch.equal(y, ref):
                    note("broadcast", a, root, n)
            for op in ("sum", "min"):
                ref = x.clone()
                comm.reduce(ref, root, op)
                for a in _algorithms("reduce", False):
                    y = x.clone()
                    comm.reduce(y, root, op, algorithm=a)
                    if r == root and not _same(y, ref, op == "min"):
                        note("reduce", a, op, root, n)
            x = _data(chunk, r, seed)
            ref = torch.empty(chunk * p) if r == root else None
            comm.gather(ref, x, root)
            full = _data(chunk * p, root, seed)
            ref_scatter = torch.empty(chunk)
            comm.scatter(ref_scatter, full, root)
            for a in _algorithms("gather", False):
                y = torch.empty(chunk * p) if r == root else None
                comm.gather(y, x, root, algorithm=a)
                if r == root and not torch.equal(y, ref):
                    note("gather", a, root, n)
                y = torch.empty(chunk)
                comm.scatter(y, full if r == root else None, root, algorithm=a)
                if not torch.equal(y, ref_scatter):
                    note("scatter", a, root, n)
        x = _data(chunk * p, r, seed).view(p, chunk)
        ref = torch.empty(p, chunk)
        comm.all_to_all(ref, x)
        for a in _algorithms("all_to_all", False):
            y = torch.empty(p, chunk)
            comm.all_to_all(y, x, algorithm=a)
            if not torch.equal(y, ref):
                note("all_to_all", a, n)


def _check_extras(comm: Communicator, bad: list) -> None:
    """Uneven all-to-all splits, bf16/fp16 inputs, non-contiguous tensors."""
    p, r = comm.size, comm.rank
    rows_to = [(r + j) % 3 for j in range(p)]  # rows this rank sends to j
    rows_from = [(j + r) % 3 for j in range(p)]  # rows j sends here
    x = _data(sum(rows_to) * 5, r, 7).view(-1, 5)
    ref = torch.empty(sum(rows_from), 5)
    comm.all_to_all(ref, x, output_splits=rows_from, input_splits=rows_to)
    y = torch.empty_like(ref)
    comm.all_to_all(y, x, output_splits=rows_from, input_splits=rows_to, algorithm="ring")
    if not torch.equal(y, ref):
        bad.append((p, "all_to_all uneven"))
    for dtype in (torch.bfloat16, torch.float16):
        x = _data(1000, r, 8, dtype)
        ref = x.clone()
        comm.all_reduce(ref, "sum")
        for a in _algorithms("all_reduce", False):
            y = x.clone()
            comm.all_reduce(y, "avg", algorithm=a)
            if y.dtype != dtype or not _same(y * p, ref, exact=False):
                bad.append((p, "all_reduce", a, dtype))
    base = _data(40 * 30, r, 9).view(40, 30)
    ref = base.t().contiguous()
    comm.all_reduce(ref, "sum")
    out_ref = torch.empty(30 * p, 40)
    comm.all_gather(out_ref, base.t().contiguous())
    for a in _algorithms("all_reduce", False):
        y = base.clone().t()  # non-contiguous
        comm.all_reduce(y, "sum", algorithm=a)
        if y.is_contiguous() or not _same(y, ref, exact=False):
            bad.append((p, "non-contiguous all_reduce", a))
    out = torch.empty(40, 30 * p).t()  # non-contiguous output
    comm.all_gather(out, base.t(), algorithm="ring")
    if not torch.equal(out, out_ref):
        bad.append((p, "non-contiguous all_gather"))


def _check_segmented(comm: Communicator, bad: list) -> None:
    """The ring cut into many segments per part (a tiny SEGMENT_BYTES here)
    equals native and moves the same bytes in the same rounds as the ring in one piece."""
    p, r = comm.size, comm.rank
    n = 1000 * p + 7  # parts of unequal sizes

    def calls() -> list:
        x, part, out = _data(n, r, 11), torch.empty(n // p), torch.empty(n // p * p)
        comm.all_reduce(x, algorithm="ring")
        comm.reduce_scatter(part, _data(n // p * p, r, 12), algorithm="ring")
        comm.all_gather(out, _data(n // p, r, 13), algorithm="ring")
        records = comm.ledger.records[-3:]
        return [x, part, out, [(c.sent_bytes, c.recv_bytes, c.rounds) for c in records]]

    whole = calls()
    saved = ring.SEGMENT_BYTES
    ring.SEGMENT_BYTES = 1000  # parts of ~4000 B: 4+ segments, more than SLOTS in flight
    try:
        cut = calls()
    finally:
        ring.SEGMENT_BYTES = saved
    ref = _data(n, r, 11)
    comm.all_reduce(ref)
    if not _same(cut[0], ref, exact=False) or cut[3] != whole[3] \
            or not all(torch.equal(a, b) for a, b in zip(cut[:3], whole[:3])):
        bad.append((p, "segmented ring"))


def _volumes(comm: Communicator, n: int) -> dict:
    """(sent, recv, inter-node sent, rounds, sent per peer) of one call per algorithm;
    S = 4n bytes."""
    comm.ledger.records.clear()
    out = {}
    for a in _algorithms("all_reduce", False) + _algorithms("all_reduce", True, comm):
        comm.all_reduce(torch.ones(n), algorithm=a)
        out[("all_reduce", a)] = comm.ledger.records[-1]
    for a in _algorithms("all_gather", False) + _algorithms("all_gather", True, comm):
        comm.all_gather(torch.empty(n), torch.ones(n // comm.size), algorithm=a)
        out[("all_gather", a)] = comm.ledger.records[-1]
    for a in _algorithms("reduce_scatter", False) + _algorithms("reduce_scatter", True, comm):
        comm.reduce_scatter(torch.empty(n // comm.size), torch.ones(n), algorithm=a)
        out[("reduce_scatter", a)] = comm.ledger.records[-1]
    comm.broadcast(torch.ones(n), 0, algorithm="tree")
    out[("broadcast", "tree")] = comm.ledger.records[-1]
    return {k: (v.sent_bytes, v.recv_bytes, v.sent_inter_node_bytes, v.rounds, v.sent_to)
            for k, v in out.items()}


def _errors(rank: int) -> dict:
    """Bad input on fresh two-rank groups (made by every rank, used by ranks 0 and 1)."""
    groups = [dist.new_group([0, 1]) for _ in range(4)]
    if rank > 1:
        return {}
    out = {}

    def comm(i: int, **kw) -> Communicator:
        return Communicator(groups[i], name=f"err{i}", ranks=[0, 1], ledger=CommLedger(), **kw)

    def catch(fn) -> str:
        try:
            fn()
        except (CommError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    c = comm(0, timeout_s=30)
    out["unknown"] = catch(lambda: c.all_reduce(torch.ones(4), algorithm="warp"))
    out["cannot"] = catch(lambda: c.all_gather(torch.empty(8), torch.ones(4), algorithm="tree"))
    out["size"] = catch(lambda: c.all_reduce(torch.ones(10 + 2 * rank), algorithm="ring"))
    out["grid"] = catch(lambda: comm(0, algorithm="torus3d"))  # refused when built
    out["splits"] = catch(lambda: c.all_to_all(torch.empty(3), torch.ones(3), output_splits=[1, 2],
                                               input_splits=[1, 2]))
    # A peer that never answers: rank 1 stays away (alive) while rank 0 waits 1 s.
    if rank == 0:
        for i, name in ((1, "ring"), (2, "native")):
            start = time.perf_counter()
            out[f"timeout_{name}"] = catch(lambda: comm(i, timeout_s=1.0, check_sizes="off")
                                           .all_reduce(torch.ones(64), algorithm=name))
            out[f"timeout_{name}_s"] = time.perf_counter() - start
    else:
        time.sleep(4.0)
    return out


def world_checks(rank: int, world: int) -> dict:
    """Worker: every check above on this rank."""
    bad: list = []
    volumes: dict = {}
    for p in range(2, world + 1):
        group = dist.new_group(list(range(p))) if p < world else dist.group.WORLD
        if rank < p:
            make = lambda node, **kw: Communicator(  # noqa: E731
                group, name=f"w{p}n{node}", ranks=list(range(p)), ledger=CommLedger(),
                node_size=node, timeout_s=120, **kw)
            _check_ops(make(0), False, bad)
            _check_extras(make(0), bad)
            _check_segmented(make(0), bad)
            for node in (0, 2, 3):  # the grids on nodes of 2 (a run's cost: seconds each)
                _check_ops(make(node, link=BANDWIDTH_LINK), True, bad, grids=node == 2)
            if p in (4, 6, 8, 5):
                volumes[p] = _volumes(make(2 if p != 6 else 3, link=BANDWIDTH_LINK), 840 * 8)
        dist.barrier()
    return {"bad": bad, "volumes": volumes, "errors": _errors(rank)}
