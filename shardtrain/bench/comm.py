"""`shardtrain bench comm`: nccl-tests for shardtrain's collectives, on this machine.

For each op, algorithm and message size, worker processes (launched here, `--nproc`) time
the collective: one warm-up call sizes the loop, then `iters` calls; the time reported is
the slowest rank's mean. Sizes follow nccl-tests: S is the all-reduce / broadcast / reduce
vector, the gathered output of all_gather and gather, the input of reduce_scatter and
scatter, each rank's send buffer of all_to_all; fp32, sum. After the fixed algorithms, the
workers fit the alpha-beta-gamma model to what they measured (fit.py) and time `auto`
(and hierarchical, whose phases are chosen by price) with those figures -- the figures
`auto` uses after `shardtrain bench calibrate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator, cost
from shardtrain.comm.dispatch import choose, serves
from shardtrain.bench import fit


PRICED = ("hierarchical", "auto")


@dataclass(frozen=True, kw_only=True)
class Spec:
    ops: tuple[str, ...]
    algorithms: tuple[str, ...]
    sizes: tuple[int, ...]  # bytes
    node_size: int
    target_s: float = 0.1  # time spent per measurement, roughly
    repeats: int = 3  # turns per (op, size); the best counts
    max_iters: int = 50
    timeout_s: float = 600.0
    measure_flops: bool = False  # also time fp32 matmuls (all processes at once)


def worker(spec: Spec) -> dict | None:
    """One benchmark process (started by `shardtrain.launch.launch_local`)."""
    from shardtrain.launch import ProcessInfo, init_distributed

    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), spec.timeout_s)
    try:
        return _measure_all(spec, info.rank, info.world_size)
    finally:
        dist.destroy_process_group()


def _measure_all(spec: Spec, rank: int, p: int) -> dict | None:
    comm = Communicator(dist.group.WORLD, name="bench", ranks=list(range(p)),
                        ledger=CommLedger(), node_size=spec.node_size, timeout_s=spec.timeout_s,
                        check_sizes="off", link=cost.Link(alpha_s=0.0, beta_s_per_byte=0.0))
    # Fixed algorithms first; those that price their choices with the link (hierarchical
    # phases, auto) run after the fit, with the fitted figures, taking turns with the best
    # fixed algorithm and auto's pick so that the comparison sees the same load.
    fixed = [a for a in spec.algorithms if a not in PRICED]
    rows = _sweep(comm, spec, lambda op, size: fixed)
    link = fit.fit(list(rows.values()), p, comm.local_size)
    figures = torch.tensor(link.figures(), dtype=torch.float64)
    dist.broadcast(figures, 0)  # identical figures, identical choices on every rank
    comm.link = link = cost.Link.from_figures(figures.tolist())
    priced = [a for a in spec.algorithms if a in PRICED]

    def rivals(op: str, size: int) -> list[str]:
        mine = [r for (o, s, _), r in rows.items() if o == op and s == size]
        best = [min(mine, key=lambda r: r["time_s"])["algorithm"]] if mine else []
        picks = [_pick(comm, op, size)] if "auto" in priced else []
        return list(dict.fromkeys(priced + best + [a for a in picks if a in fixed]))

    second = _sweep(comm, spec, rivals)
    for (op, size, a), row in second.items():
        if a == "auto":  # what it is compared with: the fixed rivals timed in the same turns
            row["rivals_s"] = {b: r["time_s"] for (o, s, b), r in second.items()
                               if (o, s) == (op, size) and b not in PRICED}
        if (op, size, a) not in rows or row["time_s"] < rows[(op, size, a)]["time_s"]:
            rows[(op, size, a)] = row
    local_add = _local_add_s_per_byte()
    flops = _matmul_flops_per_s() if spec.measure_flops else None
    if rank:
        return None
    return {"rows": list(rows.values()), "link": link, "p": p, "local_size": comm.local_size,
            "node_size": spec.node_size, "local_add_s_per_byte": local_add,
            "flops_per_s": flops}


def _sweep(comm: Communicator, spec: Spec, algorithms) -> dict[tuple, dict]:
    """Every (op, size) and the algorithms `algorithms(op, size)` names for it, keyed by
    (op, size, algorithm). The algorithms of one (op, size) take turns `repeats` times and
    each keeps its best turn, so that load from elsewhere hits them alike."""
    rows = {}
    for op in spec.ops:
        for size in spec.sizes:
            able = [a for a in algorithms(op, size) if a in ("native", "auto") or serves(a, op)]
            turns = [[_row(comm, op, size, a, spec) for a in able] for _ in range(spec.repeats)]
            for a, column in zip(able, zip(*turns)):
                rows[(op, size, a)] = min(column, key=lambda r: r["time_s"])
    return rows


def _pick(comm: Communicator, op: str, size: int) -> str:
    """The algorithm `auto` runs for this call."""
    return choose(op, _call(comm, op, size, "native")[1], requested="auto", default="auto",
                  group=comm.name, p=comm.size, local_size=comm.local_size, link=comm.link)


def _row(comm: Communicator, op: str, size: int, algorithm: str, spec: Spec) -> dict:
    run, nbytes = _call(comm, op, size, algorithm)
    seconds, iters = _time(run, spec)
    chosen = _pick(comm, op, size) if algorithm == "auto" else algorithm
    comm.ledger.records.clear()
    return {"op": op, "algorithm": algorithm, "chosen": chosen, "bytes": nbytes,
            "time_s": seconds, "iters": iters}


def _call(comm: Communicator, op: str, size: int, algorithm: str):
    """A closure running one call of `op` on S = `size` bytes (rounded to p elements)."""
    p = comm.size
    n = max(p, size // 4 // p * p)
    m = n // p
    kw = {"algorithm": algorithm}
    if op == "all_reduce":
        x = torch.zeros(n)
        return (lambda: comm.all_reduce(x, **kw)), 4 * n
    if op == "broadcast":
        x = torch.zeros(n)
        return (lambda: comm.broadcast(x, 0, **kw)), 4 * n
    if op == "reduce":
        x = torch.zeros(n)
        return (lambda: comm.reduce(x, 0, **kw)), 4 * n
    if op == "all_gather":
        out, inp = torch.empty(n), torch.zeros(m)
        return (lambda: comm.all_gather(out, inp, **kw)), 4 * n
    if op == "reduce_scatter":
        out, inp = torch.empty(m), torch.zeros(n)
        return (lambda: comm.reduce_scatter(out, inp, **kw)), 4 * n
    if op == "gather":
        out, inp = torch.empty(n), torch.zeros(m)
        return (lambda: comm.gather(out if comm.rank == 0 else None, inp, 0, **kw)), 4 * n
    if op == "scatter":
        out, inp = torch.empty(m), torch.zeros(n)
        return (lambda: comm.scatter(out, inp if comm.rank == 0 else None, 0, **kw)), 4 * n
    out, inp = torch.empty(p, m), torch.zeros(p, m)
    return (lambda: comm.all_to_all(out, inp, **kw)), 4 * n


def _time(run, spec: Spec) -> tuple[float, int]:
    """The slowest rank's mean seconds per call, and the number of calls timed."""
    dist.barrier()
    start = time.perf_counter()
    run()  # warm-up; its time sizes the loop (the same count on every rank)
    first = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(first, dist.ReduceOp.MAX)
    iters = int(min(spec.max_iters, max(1, spec.target_s / max(first.item(), 1e-9))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(mean, dist.ReduceOp.MAX)
    return mean.item(), iters


def _local_add_s_per_byte() -> float:
    """gamma measured directly: an in-place fp32 a += b over 16 MiB, all ranks at once."""
    a, b = torch.zeros(2**22), torch.ones(2**22)
    a.add_(b)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        a.add_(b)
    return (time.perf_counter() - start) / 10 / (4 * 2**22)


def _matmul_flops_per_s(n: int = 1024, seconds: float = 2.0) -> float:
    """fp32 matmul FLOP/s of one process while every process multiplies (the mean over
    ranks): what a rank of a local run can count on."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    dist.barrier()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    rate = torch.tensor([2 * n**3 * calls / (time.perf_counter() - start)], dtype=torch.float64)
    dist.all_reduce(rate)
    return rate.item() / dist.get_world_size()
