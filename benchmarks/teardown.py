"""Leaving the process group at the end of a benchmark's worker without hanging.

`torch.distributed.destroy_process_group()` forgets the groups but does not free them: a
group lives on while anything holds it (a DDP model's reducer, a trainer's mesh), and its
destructor runs wherever the last holder dies. Gloo's destructor joins the group's worker
threads while holding the GIL; a worker thread still letting go of its last collective's
tensor (one that a Python object owned) needs the GIL to do so, and the process deadlocks.
In issue 39 `dp_vs_torch_ddp.py` hung so in 2 of 2 runs: one of four ranks sat in
~ProcessGroupGloo (the main thread, from ~Reducer, as the worker returned after
destroy_process_group) while the group's worker thread waited for the GIL in
~AsyncAllreduceWork (the last step's loss all-reduce).

`run_then_leave(measure, *args)` runs `measure(*args)`, which builds and uses every object
that holds a group, and leaves in the order that cannot deadlock:
1. `measure` returns: its objects are freed (gc.collect(): those in reference cycles too)
   while the groups are still registered, so no group's destructor runs yet;
2. a barrier: every rank has finished its collectives, and this rank waited for it with the
   GIL released, so the worker threads have let go of their work;
3. destroy_process_group() drops the last references: the destructors find idle threads.
A failure in `measure` propagates without leaving: the process is on its way out (nothing
outlives it to hang in), and a barrier would wait for peers that may never come.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def run_then_leave(measure: Callable[..., T], *args) -> T:
    result = measure(*args)  # a failure propagates as it is (module doc)
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result
