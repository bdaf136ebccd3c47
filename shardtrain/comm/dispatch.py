"""Which algorithm serves a call, and the cross-rank agreement checks made before it runs.

Choice: an algorithm named for the call must serve the op (else a ValueError naming the
group, the op and the algorithms that can); the run's algorithm (comm.algorithm) serves the
ops it implements and leaves the others to the backend (`native`); `auto` asks the cost
model (`cost.best_algorithm`) for the fastest algorithm for this op, size, group and node
layout, the backend's own included, priced with this machine's calibration.

Checks: a rank that calls a collective with a different size, dtype, op or algorithm than
its peers would hang or corrupt memory (Gloo aborts the process on an oversized message).
Before the first call of each op on a group (or every call, check_sizes="all"), the ranks
compare those figures with one small native all-reduce and fail with a message naming the
group and op. These figures are metadata: CPU tensors on the group's CPU side channel
(`meta`: the Gloo group itself, or the Gloo group the mesh creates beside an NCCL one).

Devices: our point-to-point algorithms run on CPU tensors over Gloo. On a CUDA group only
`native` (NCCL's own collectives) runs; `on_device` refuses the others, and config
validation (shardtrain.launch.check_device) refuses them before a run starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtrain.cost import collectives as cost
from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm.lane import wait_native
from shardtrain.comm.p2p import CommError

ALGORITHMS = ("native", *IMPLEMENTATIONS, "auto")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.int8, torch.uint8, torch.bool)
_REDUCE = ("sum", "avg", "max", "min", "")
META = torch.device("cpu")  # metadata travels on the CPU side channel (module doc)


def on_device(name: str, device: torch.device, group: str) -> None:
    """Refuse one of our algorithms on a CUDA group (they are written for Gloo)."""
    if device.type == "cuda" and name != "native":
        raise ValueError(f"comm.algorithm={name!r} on group {group}: our point-to-point "
                         "algorithms run on CPU (Gloo) only; on CUDA use comm.algorithm=native")


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
