"""`shardtrain bench comm`: nccl-tests for shardtrain's collectives, on this machine.

For each op and message size, worker processes (launched here, `--nproc`) time every
algorithm asked for. Sizes follow nccl-tests: S is the all-reduce / broadcast / reduce
vector, the gathered output of all_gather and gather, the input of reduce_scatter and
scatter, each rank's send buffer of all_to_all; fp32, sum.

The statistic: every call is timed on its own. The ranks leave a barrier together, each
times the call, and the call's time is the slowest rank's (a collective is done when its
last rank is); the figure reported is the median over the calls. The algorithms of one
(op, size) take turns call by call, so drift in the machine's load hits them alike, and
a call that a burst of load delays (with 4 processes on 2 cores the same call can take
several times as long from one turn to the next) moves the median little, where it would
move a mean. One warm-up call per algorithm allocates its buffers and sizes the count of
calls, the same on every rank: about `target_s` of calls per algorithm, at least
`repeats`; the order of the turns rotates from call to call, so no algorithm always runs
after the same one.

After the fixed algorithms, the workers fit the alpha-beta-gamma model to what they
measured (fit.py) and time `auto` (and hierarchical, whose phases are chosen by price) with
those figures -- the figures `auto` uses after `shardtrain bench calibrate` -- taking turns
with the best fixed algorithm and auto's pick; an algorithm timed in both sweeps reports
the median of all its calls.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtrain.comm import CommLedger, Communicator
from shardtrain.cost import collectives as cost, topology
from shardtrain.comm.dispatch import choose, serves
from shardtrain.bench import fit


PRICED = ("hierarchical", "auto")


@dataclass(frozen=True, kw_only=True)
class Spec:
    ops: tuple[str, ...]
    algorithms: tuple[str, ...]
    sizes: tuple[int, ...]  # bytes
    node_size: int
    target_s: float = 0.3  # time spent per measurement, roughly
    repeats: int = 5  # calls at least (with 3, one algorithm timed twice at 64 MiB: 25% apart)
    max_iters: int = 100
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
    link = fit.fit(list(rows.values()), p, comm.local_size, dist.get_backend())
    figures = torch.tensor(link.figures(), dtype=torch.float64)
    dist.broadcast(figures, 0)  # identical figures, identical choices on every rank
    comm.link = link = cost.Link.from_figures(figures.tolist(), link.backend)
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
                               if (o, s) == (op, size) and b != "auto"}
        if (op, size, a) in rows:  # timed in both sweeps: the median of all its calls
            row = {**row, **_statistic(rows[(op, size, a)]["calls_s"] + row["calls_s"])}
        rows[(op, size, a)] = row
    local_add = _local_add_s_per_byte()
    flops = _matmul_flops_per_s() if spec.measure_flops else None
    if rank:
        return None
    for row in rows.values():
        del row["calls_s"]
    return {"rows": list(rows.values()), "link": link, "p": p, "local_size": comm.local_size,
            "node_size": spec.node_size, "local_add_s_per_byte": local_add,
            "flops_per_s": flops}


def _sweep(comm: Communicator, spec: Spec, algorithms) -> dict[tuple, dict]:
    """Every (op, size) and the algorithms `algorithms(op, size)` names for it, keyed by
    (op, size, algorithm); the algorithms of one (op, size) take turns call by call."""
    rows = {}
    for op in spec.ops:
        for size in spec.sizes:
            able = [a for a in algorithms(op, size)
                    if a in ("native", "auto") or _lays_out(comm, a, op)]
            closure, nbytes = _call(comm, op, size)
            for a, seconds in zip(able, _interleaved([closure(a) for a in able], spec)):
                chosen = _pick(comm, op, size) if a == "auto" else a
                rows[(op, size, a)] = {"op": op, "algorithm": a, "chosen": chosen,
                                       "bytes": nbytes, **_statistic(seconds)}
            comm.ledger.records.clear()
    return rows


def _lays_out(comm: Communicator, algorithm: str, op: str) -> bool:
    """Whether `algorithm` runs `op` on this group: it implements the op, and a grid
    algorithm finds its grid (torus3d: not on 4 ranks)."""
    return serves(algorithm, op) and (algorithm not in topology.GRID_OPS or algorithm in
                                      cost.supported(op, comm.size, comm.local_size))


def _interleaved(runs: list, spec: Spec) -> list[list[float]]:
    """Per closure, the seconds of each timed call (the slowest rank's), the closures
    taking turns call by call (in a rotating order) after one warm-up call each."""
    warm = torch.tensor([_timed(run) for run in runs], dtype=torch.float64)
    dist.all_reduce(warm, dist.ReduceOp.MAX)  # the same count of calls on every rank
    per_call = max(warm.mean().item(), 1e-9)
    count = int(min(spec.max_iters, max(spec.repeats, spec.target_s / per_call)))
    seconds = torch.zeros(count, len(runs), dtype=torch.float64)  # [call, closure]
    for k in range(count):  # the order rotates, so no closure always follows the same one
        for step in range(len(runs)):
            j = (k + step) % len(runs)
            seconds[k, j] = _timed(runs[j])
    dist.all_reduce(seconds, dist.ReduceOp.MAX)
    return seconds.T.tolist()


def _timed(run) -> float:
    """Seconds of one call on this rank, the ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _statistic(seconds: list[float]) -> dict:
    """The figures of one measurement: the median call (`time_s`), the number of calls
    (`iters`), and the calls themselves (`calls_s`, dropped from the result)."""
    return {"time_s": statistics.median(seconds), "iters": len(seconds),
            "calls_s": list(seconds)}


def _pick(comm: Communicator, op: str, size: int) -> str:
    """The algorithm `auto` runs for this call."""
    return choose(op, 4 * _elements(comm.size, size), requested="auto", default="auto",
                  group=comm.name, p=comm.size, local_size=comm.local_size, link=comm.link)


def _elements(p: int, size: int) -> int:
    """fp32 elements of S = `size` bytes, rounded down to a multiple of p (at least p)."""
    return max(p, size // 4 // p * p)


def _call(comm: Communicator, op: str, size: int):
    """A function from an algorithm to a closure running one call of `op` on S = `size`
    bytes with it, and S. All algorithms share the buffers."""
    p, n = comm.size, _elements(comm.size, size)
    root = comm.rank == 0
    if op in ("all_reduce", "broadcast", "reduce"):
        x = torch.zeros(n)
        calls = {"all_reduce": lambda a: comm.all_reduce(x, algorithm=a),
                 "broadcast": lambda a: comm.broadcast(x, 0, algorithm=a),
                 "reduce": lambda a: comm.reduce(x, 0, algorithm=a)}
    elif op in ("all_gather", "gather"):
        out, inp = torch.empty(n), torch.zeros(n // p)
        calls = {"all_gather": lambda a: comm.all_gather(out, inp, algorithm=a),
                 "gather": lambda a: comm.gather(out if root else None, inp, 0, algorithm=a)}
    elif op in ("reduce_scatter", "scatter"):
        out, inp = torch.empty(n // p), torch.zeros(n)
        calls = {"reduce_scatter": lambda a: comm.reduce_scatter(out, inp, algorithm=a),
                 "scatter": lambda a: comm.scatter(out, inp if root else None, 0, algorithm=a)}
    else:
        out, inp = torch.empty(p, n // p), torch.zeros(p, n // p)
        calls = {"all_to_all": lambda a: comm.all_to_all(out, inp, algorithm=a)}
    return (lambda a: lambda: calls[op](a)), 4 * n


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
