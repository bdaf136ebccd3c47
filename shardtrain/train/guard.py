"""Faults in the training loop: the guard against non-finite steps, and the two injection
hooks that make a rank hang or its loss NaN on purpose (docs/faults.md).

The guard. Whether a step is skipped, and whether it is *bad* (non-finite for a reason loss
scaling does not explain), is decided in one place, the loss scaler
(parallel/precision.py), from the gradient norm and the replica-averaged loss: the same
values on every rank, so every rank skips the same step without a collective of its own.
This guard only counts: after `train.max_bad_steps` bad steps in a row, the next one stops
the run with a `NonFiniteError` naming the step and the newest checkpoint (written before
the bad step, so its weights are good: a skipped step changes nothing). The default 0 stops
at the first bad step, as Megatron-LM's NaN check (check_for_nan_in_loss_and_grad) does; a
limit k > 0 rides out k transient bad batches in a row, the PaLM paper's remedy for loss
spikes being to skip the batches around them (Chowdhery et al. 2022, sec. 5.1).

The hooks (`train.inject_hang`, `train.inject_nan`, `train.inject_kill`) exist for the fault
tests (tests/test_hang.py, tests/test_nan_guard.py, tests/test_restart.py): config fields
like train.slow_ranks, visible and validated, never set by a real run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from shardtrain.config.faults import parse_injection


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row: the run stops (the message says where to go on)."""


class BadStepGuard:
    """Counts bad steps in a row (`consecutive`) and in all (`total`). `last_good`: the
    run's last checkpoint (train/checkpoint/saver.py `committed`: the one this run wrote or
    resumed from, not the newest name in the directory), or None."""

    def __init__(self, limit: int, precision: str, *, last_good: Callable[[], Path | None]):
        self.limit, self.precision, self.last_good = limit, precision, last_good
        self.consecutive = self.total = 0

    def check(self, record: dict) -> None:
        """After each step's metrics were written: count it, raise past the limit."""
        if not record.get("bad_step"):
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive <= self.limit:
            return
        found = self.last_good()
        last = (f"The last good checkpoint is {found} (resume from it with "
                "--checkpoint.resume latest, after the fix)") if found else \
            "There is no checkpoint yet (checkpoint.every sets how often one is saved)"
        scale = f", loss scale {record.get('loss_scale', 1.0):g}" \
            if self.precision.startswith("fp16") else ""  # fp16, fp16-true: scaled
        raise NonFiniteError(
            f"step {record['step']}: loss {record['loss']} / gradient norm "
            f"{record['grad_norm']} not finite (train.precision={self.precision}{scale}); the "
            f"step was skipped on every rank (no weight or optimizer change), and that is "
            f"{self.consecutive} non-finite step(s) in a row, over train.max_bad_steps="
            f"{self.limit}: the run stops. {last}. Usual causes: a "
            "learning rate too high or too little warm-up, no gradient clipping "
            "(optim.grad_clip), fp16's range (try train.precision=bf16), or NaN/inf in the "
            "data; raise train.max_bad_steps to ride out rare bad batches.")


def hang_here(spec: str, rank: int, step: int) -> None:
    """train.inject_hang: sleep if this rank and step (1-based) are the ones named."""
    fault = parse_injection("inject_hang", spec)
    if fault is not None and (fault.rank, fault.step) == (rank, step):
        time.sleep(fault.seconds)


@contextmanager
def nan_loss(module: nn.Module, spec: str, rank: int, step: int):
    """train.inject_nan: within the block, at that rank and step, every output of `module`
    (this rank's model or pipeline stage) is multiplied by NaN, so its loss and, through
    backward, its gradients are NaN, as a diverged forward would make them."""
    fault = parse_injection("inject_nan", spec)
    if fault is None or (fault.rank, fault.step) != (rank, step):
        yield
        return
    handle = module.register_forward_hook(lambda _m, _args, out: out * float("nan"))
    try:
        yield
    finally:
        handle.remove()


def restart_count() -> int:
    """How many times the launcher has restarted this job (torch elastic's count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_here(spec: str, rank: int, step: int) -> None:
    """train.inject_kill: SIGKILL this process right after that rank's step (its checkpoint,
    if one was due, written), in the job's first attempt only, so a restarted job runs
    through. A SIGKILL is what an out-of-memory kill or a lost node looks like to the other
    ranks: no exception, no cleanup, a peer that stops answering."""
    fault = parse_injection("inject_kill", spec)
    if fault is not None and (fault.rank, fault.step) == (rank, step) and not restart_count():
        os.kill(os.getpid(), signal.SIGKILL)
