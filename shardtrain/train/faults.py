"""Fault injection, for the tests of recovery (automatic restart, docs/checkpoints.md).

`SHARDTRAIN_KILL_AT="RANK:STEP"` in a worker's environment makes global rank RANK kill
itself with SIGKILL right after it finishes optimizer step STEP (its checkpoint, if one is
due, written first), in the job's first attempt only: the restarted job runs through. A
SIGKILL is what an out-of-memory kill or a lost node looks like to the other ranks: no
exception, no cleanup, a peer that stops answering.
"""

from __future__ import annotations

import os
import signal

KILL_AT = "SHARDTRAIN_KILL_AT"


def restart_count() -> int:
    """How many times the launcher has restarted this job (torch elastic's count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_point(rank: int, step: int) -> None:
    """SIGKILL this process if SHARDTRAIN_KILL_AT names this rank and step (first attempt)."""
    spec = os.environ.get(KILL_AT)
    if not spec or restart_count() > 0:
        return
    at_rank, _, at_step = spec.partition(":")
    if int(at_rank) == rank and int(at_step) == step:
        os.kill(os.getpid(), signal.SIGKILL)
