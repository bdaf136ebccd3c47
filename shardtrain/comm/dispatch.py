"""Algorithm dispatch: which algorithm serves a call, the cross-rank agreement checks made
before it runs, and running it -- the backend's own collective or one of ours on a Team
(p2p.py) -- in issue order, with the Handle a caller waits on.

Choice: an algorithm named for the call must serve the op (else a ValueError naming the
group, the op and the algorithms that can); the run's algorithm (comm.algorithm) serves the
ops it implements and leaves the others to the backend (`native`); `auto` asks the cost
model (`cost.best_algorithm`) for the fastest algorithm for this op, size, group and node
layout, the backend's own included, priced with the link the group was built with.

Checks: a rank that calls a collective with a different size, dtype, op or algorithm than
its peers would hang or corrupt memory (Gloo aborts the process on an oversized message).
Before the first call of each op on a group (or every call, check_sizes="all"), the ranks
compare those figures with one small native all-reduce and fail with a message naming the
group and op. These figures are metadata: CPU tensors on the group's CPU side channel
(`meta`: the Gloo group itself, or the Gloo group the mesh creates beside an NCCL one).

Devices: our point-to-point algorithms run on CPU tensors over Gloo. On a CUDA group only
`native` (NCCL's own collectives) runs; `on_device` refuses the others, and config
validation (shardtrain.launch.check_device) refuses them before a run starts. Every tensor
handed to a call must live on the group's device (`placed`, checked on every call).

Where a call runs (the Lane). On Gloo every wait blocks the waiting thread until the
transfer is done. A synchronous call with nothing queued runs right away on the caller's
thread (no hand-off cost for small messages); an asynchronous call, or any call issued while
earlier ones are still queued, runs on the communicator's lane thread, so DP's bucket
all-reduces proceed while backward computes (torch releases the GIL inside tensor ops and
waits). Calls made from inside a running job (a compressed all-reduce calling all_to_all)
run inline. Order matters twice: peers match point-to-point messages in posting order, and
Gloo matches native collectives in issue order; queueing every call of a group behind the
earlier ones keeps both orders identical on every rank. On NCCL there is no lane thread: a
call only enqueues work on the GPU, and its wait makes the current CUDA stream, not the
host, wait (`wait_native`), so the host runs ahead and transfers overlap compute by
themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm.ledger import CommRecord
from shardtrain.comm.p2p import CommError, Team, wait_native
from shardtrain.cost import collectives as cost, topology

ALGORITHMS = ("native", *IMPLEMENTATIONS, "auto")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.int8, torch.uint8, torch.bool)
_REDUCE = ("sum", "avg", "max", "min", "")
META = torch.device("cpu")  # metadata travels on the CPU side channel (module doc)
CHECKS = ("first", "all", "off")
PRICED = ("auto", "hierarchical")  # algorithms that price their choices with the link


def on_device(name: str, device: torch.device, group: str) -> None:
    """Refuse one of our algorithms on a CUDA group (they are written for Gloo)."""
    if device.type == "cuda" and name != "native":
        raise ValueError(f"comm.algorithm={name!r} on group {group}: our point-to-point "
                         "algorithms run on CPU (Gloo) only; on CUDA use comm.algorithm=native")


def on_grid(name: str, size: int, local_size: int, group: str) -> None:
    """Refuse, when the communicator is built, a grid algorithm on a group it cannot lay
    out (cost/topology.py): a clear error before any call, not a failure inside one."""
    if name not in ("mesh2d", "torus3d", "ring_tree") or size <= 1:
        return
    if name == "ring_tree" and local_size == size:
        return  # one node: the ring alone
    if topology.grid_of(name, size, local_size) is None:
        raise ValueError(topology.no_grid(name, size, f"group {group}"))


def placed(comm, op: str, *tensors: torch.Tensor | None) -> None:
    """Refuse a tensor that is not on `comm`'s device (Gloo: the CPU; NCCL: the rank's GPU):
    the backend would fail deep inside, or a CPU tensor would take Gloo's path on a GPU run
    without a word. Metadata only (no sync): every call of every group, world size 1
    included, checks its tensors (None: a root-only argument elsewhere). A group's device
    named without an index ("cuda") takes any GPU's tensor."""
    want = comm.device
    for have in (t.device for t in tensors if t is not None):
        if have.type == want.type and (want.index is None or have.index == want.index):
            continue
        raise ValueError(f"{op} on group {comm.name}: a tensor on {have}, but the group's "
                         f"payload lives on {want}; move it there (.to({str(want)!r})) or "
                         "make it there (device=)")


def serves(name: str, op: str, *, equal_splits: bool = True) -> bool:
    """Whether algorithm `name` can run this call (every group size and node layout is
    handled; Bruck's all_to_all needs equal splits)."""
    if op not in IMPLEMENTATIONS.get(name, {}):
        return False
    return equal_splits or not (name == "recursive_doubling" and op == "all_to_all")


def choose(op: str, nbytes: int, *, requested: str | None, default: str, group: str, p: int,
           local_size: int, link: cost.Link | None, equal_splits: bool = True) -> str:
    name = requested or default
    if name not in ALGORITHMS:
        raise ValueError(f"{op} on group {group}: unknown algorithm {name!r}; use one of "
                         f"{', '.join(ALGORITHMS)}")
    if name == "native":
        return name
    if name == "auto":
        best = cost.best_algorithm(op, nbytes, p, link, local_size=local_size, native=True)
        if best == "native" or serves(best, op, equal_splits=equal_splits):
            return best
        able = [a for a in cost.supported(op, p, local_size)
                if a != "native" and serves(a, op, equal_splits=equal_splits)]
        return min(able, key=lambda a: cost.cost(op, nbytes, p, link, algorithm=a,
                                                 local_size=local_size).time_s)
    if serves(name, op, equal_splits=equal_splits):
        return name
    if requested is None:
        return "native"  # the run's algorithm does not implement this op
    able = [a for a in ALGORITHMS[:-1]
            if a == "native" or serves(a, op, equal_splits=equal_splits)]
    why = "uneven splits" if op in IMPLEMENTATIONS[name] else f"it has no {op}"
    raise ValueError(f"{op} on group {group}: algorithm {name!r} cannot serve this call "
                     f"({why}); use one of {', '.join(able)}")


def choose_for(comm, op: str, flat: torch.Tensor, requested: str | None, *,
               numel: int | None = None, equal_splits: bool = True) -> str:
    """`choose` for a call of `comm` (a Communicator) on `flat`."""
    nbytes = (flat.numel() if numel is None else numel) * flat.element_size()
    if (requested or comm.algorithm) in PRICED and comm.link is None:
        _no_link(comm.name, requested or comm.algorithm)
    name = choose(op, nbytes, requested=requested, default=comm.algorithm, group=comm.name,
                  p=comm.size, local_size=comm.local_size, link=comm.link,
                  equal_splits=equal_splits)
    on_device(name, comm.device, comm.name)
    return name


def agreed_link(comm) -> cost.Link:
    """Group rank 0's link, so that every rank's `auto` makes the same choices; native
    priced as this group's backend runs it. Metadata: over the CPU side channel."""
    if comm.link is None:
        _no_link(comm.name, comm.algorithm)
    figures = torch.tensor(comm.link.figures(), dtype=torch.float64, device=META)
    dist.broadcast(figures, comm.ranks[0], group=comm.meta)
    gloo = dist.get_backend(comm.group) == "gloo"  # else NCCL-style collectives
    return cost.Link.from_figures(figures.tolist(), "gloo" if gloo else "nccl")


def _no_link(group: str, algorithm: str) -> None:
    raise ValueError(f"algorithm {algorithm!r} on group {group} prices its choices with a "
                     "link, and none was given: pass link= when building the communicator "
                     "(cost.hardware.runtime_link)")


def check_due(comm, op: str, *, peek: bool = False) -> bool:
    """Whether this call of `op` compares sizes across ranks first (comm.check_sizes)."""
    due = comm.check_sizes == "all" or (comm.check_sizes == "first" and op not in comm.checked)
    if not peek:
        comm.checked.add(op)
    return due


def check_agreement(group: dist.ProcessGroup, where: str, timeout_s: float, *, numel: int,
                    dtype: torch.dtype, reduce_op: str, algorithm: str) -> None:
    """All ranks compare (numel, dtype, reduce op, algorithm); all raise on disagreement."""
    mine = torch.tensor([numel, _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES),
                         _REDUCE.index(reduce_op), ALGORITHMS.index(algorithm)],
                        dtype=torch.int64, device=META)
    both = torch.cat([mine, -mine])
    wait_native(dist.all_reduce(both, dist.ReduceOp.MAX, group=group, async_op=True), where,
                timeout_s)
    high, low = both[:4], -both[4:]
    names = ("element count", "dtype", "reduce op", "algorithm")
    decode = (str, lambda i: str(_DTYPES[i]).removeprefix("torch.") if i < len(_DTYPES) else "?",
              lambda i: _REDUCE[i] or "-", lambda i: ALGORITHMS[i])
    for k in range(4):
        if high[k] != low[k]:
            raise CommError(
                f"{where}: ranks disagree on the {names[k]} (this rank "
                f"{decode[k](int(mine[k]))}; across the group from {decode[k](int(low[k]))} to "
                f"{decode[k](int(high[k]))}). Every rank must pass tensors of the same size "
                "and dtype and the same op, and resolve the same algorithm")


def check_splits(group: dist.ProcessGroup, where: str, timeout_s: float, out_rows: list[int],
                 in_rows: list[int]) -> None:
    """all_to_all: what each peer sends must be what this rank expects from it."""
    sent = torch.tensor(in_rows, dtype=torch.int64, device=META)
    told = torch.empty_like(sent)
    wait_native(dist.all_to_all_single(told, sent, group=group, async_op=True), where, timeout_s)
    mine = told.tolist() != list(out_rows)
    bad = torch.tensor([int(mine)], dtype=torch.int64, device=META)
    wait_native(dist.all_reduce(bad, dist.ReduceOp.MAX, group=group, async_op=True), where,
                timeout_s)
    if bad.item():
        what = (f"this rank expects {list(out_rows)} rows from its peers, which send "
                f"{told.tolist()}" if mine else "another rank's output_splits do not match")
        raise CommError(f"{where}: output_splits disagree with the peers' input_splits "
                        f"({what}); pass each rank the splits its peers use")


def run(comm, op: str, name: str, record: CommRecord, *, async_op: bool, agree: dict,
        native: Callable[[], dist.Work], body: Callable[[Team], None],
        finish: Callable[[], None] | None, splits: tuple | None = None) -> Handle:
    """Run one call of `comm` (a Communicator): on its lane, or -- a native async call on
    NCCL, or on Gloo with nothing queued and nothing to check -- issued at once. The
    agreement check, when due, is decided when the call runs, so every rank decides it at
    the same call. On NCCL `record.time_s` is host time (launch to the stream wait)."""
    where = f"{op} on group {comm.name} (algorithm {name})"
    started = time.perf_counter()

    def issue():  # the flight recorder's entry, opened when the call starts (flight.py)
        return comm.ledger.flight.issue(comm, op, tag=record.tag, numel=record.numel,
                                        nbytes=record.msg_bytes, algorithm=name)

    def check() -> None:
        if check_due(comm, op):  # metadata: over the CPU side channel
            check_agreement(comm.meta, where, comm.timeout_s, algorithm=name, **agree)
            if splits is not None:
                check_splits(comm.meta, where, comm.timeout_s, *splits)

    def job() -> None:
        entry = issue()
        check()
        if name == "native":
            entry.work = native()
            wait_native(entry.work, where, comm.timeout_s, streamed=comm.streamed)
        else:
            team = Team(comm.group, where, comm.timeout_s, tuple(comm.nodes),
                        tuple(range(comm.size)), comm.rank, comm.buffers, comm.device,
                        comm.tag, comm.link)
            body(team)
            t = team.traffic
            record.sent_bytes, record.recv_bytes = t.sent, t.recv
            record.sent_inter_node_bytes, record.rounds = t.sent_inter_node, t.rounds
            record.sent_to = t.sent_to
        if finish is not None:
            finish()
        record.time_s = time.perf_counter() - started
        comm.ledger.flight.complete(entry)

    direct = name == "native" and async_op and not comm.lane.busy()
    if direct and (comm.streamed or not check_due(comm, op, peek=True)):
        entry = issue()
        check()
        entry.work = native()
        return Handle(work=entry.work, record=record, finish=finish, where=where,
                      timeout_s=comm.timeout_s, streamed=comm.streamed,
                      done=lambda: comm.ledger.flight.complete(entry))
    handle = Handle(future=comm.lane.run(job, async_op=async_op))
    if not async_op:
        handle.wait()
    return handle


class Handle:
    """A launched collective: `wait()` blocks until it is done (and raises its error).

    Either a running lane job (`future`), or a native collective issued directly (`work`),
    whose finishing step -- the division of an average, a copy back into a non-contiguous
    tensor -- and ledger time stamp happen on wait."""

    def __init__(self, *, future: Future | None = None, work: dist.Work | None = None,
                 record: CommRecord | None = None, finish: Callable[[], None] | None = None,
                 where: str = "", timeout_s: float = 300.0, streamed: bool = False,
                 done: Callable[[], None] | None = None):
        self._future, self._work, self._record, self._finish = future, work, record, finish
        self._where, self._timeout_s, self._streamed = where, timeout_s, streamed
        self._done_hook = done  # closes the call's flight recorder entry
        self._start = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        if self._future is not None:
            self._future.result()
            return
        if self._work is not None:
            wait_native(self._work, self._where, self._timeout_s, streamed=self._streamed)
        if self._done_hook is not None:
            self._done_hook()
        if self._finish is not None:
            self._finish()
        if self._record is not None:
            self._record.time_s = time.perf_counter() - self._start
