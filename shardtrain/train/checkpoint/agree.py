"""Ranks agreeing on what each of them did alone: every rank's outcome (ok, or its error)
reaches every rank, which then all act alike -- all go on, or all raise the same error.

A checkpoint save is written by every rank, each on its own, and committed by the main
rank; resuming, each rank checks its share of the checkpoint's bytes. A rank that raised
alone would leave its peers waiting in the next collective until the communication
timeout (issue 34: a full disk; issue 39: any other write error, and an asynchronous
save whose main rank waited `comm.timeout_s` for a part that never came). So each of those
steps ends with an agreement: the free-space check, the write and the commit of every save
(train/checkpoint/saver.py, on the training thread or on an asynchronous save's thread
alike) and resume's content check (checkpoint.py `resolve_resume`).

The ranks agree through the job's key-value store, not through collectives: an
asynchronous save's thread agrees while the training thread runs the step's collectives on
the same groups, and the communication ledger is unchanged. Each agreement costs a rank a
few store operations, whatever the world size: a failing rank adds itself to the failure
count and offers its error as the agreement's (compare-and-set: the first one stays), then
every rank adds itself to the arrival count; the last to arrive opens the gate all of them
wait on. A rank that never arrives (it died) leaves the others waiting for the store's
timeout (the job's `comm.timeout_s`), as a lost peer does in any collective.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

EXIT_CODE = 74  # sysexits.h EX_IOERR: the run stopped on an I/O error (not a bad input: 2)


class SaveFailed(Exception):
    """A checkpoint was not written, on every rank alike: stop training; the message (the
    same on every rank, naming the failing rank and the cause) is for the main rank."""


@dataclass(frozen=True)
class Outcome:
    failed: int  # ranks that failed
    rank: int = -1  # one of them (the first to say so)
    error: str = ""  # its error

    def __bool__(self) -> bool:
        return self.failed > 0


def describe(error: BaseException) -> str:
    """An error as one line: an OSError as Python writes it ("[Errno 5] ...: 'path'")."""
    if isinstance(error, OSError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class Agreement:
    """The agreements of `size` ranks (0 .. size - 1) that every one of them makes, in the
    same order. Keys are numbered per `name` and per process, not per object: the n-th
    agreement of a name is the same on every rank, and a process that builds a second
    trainer in the same process group (tests do) never meets a key already used."""

    _numbers: ClassVar[defaultdict[str, itertools.count]] = defaultdict(itertools.count)

    def __init__(self, name: str, rank: int, size: int):
        self.name, self.rank, self.size = name, rank, size
        self.store = _job_store() if size > 1 else None

    def _key(self) -> str:
        return f"shardtrain/agree/{self.name}/{next(self._numbers[self.name])}"

    def outcome(self, error: str = "") -> Outcome:
        """Every rank's outcome ("": ok, else its error in one line), agreed: how many
        failed, and one failure's rank and error."""
        if self.store is None:
            return Outcome(1, self.rank, error) if error else Outcome(0)
        key = self._key()
        if error:  # before arriving: every failure is counted once the gate opens
            self.store.compare_set(f"{key}/error", "", f"{self.rank}\t{error}")
            self.store.add(f"{key}/failed", 1)
        self._arrive(key)
        failed = self.store.add(f"{key}/failed", 0)
        if not failed:
            return Outcome(0)
        rank, _, text = self.store.get(f"{key}/error").decode().partition("\t")
        return Outcome(failed, int(rank), text)

    def total(self, value: int) -> int:
        """Every rank's `value`, added up."""
        if self.store is None:
            return value
        key = self._key()
        self.store.add(f"{key}/sum", value)
        self._arrive(key)
        return self.store.add(f"{key}/sum", 0)

    def _arrive(self, key: str) -> None:
        """Until every rank has arrived at `key`."""
        if self.store.add(f"{key}/arrived", 1) == self.size:
            self.store.set(f"{key}/open", "1")
        self.store.wait([f"{key}/open"])


def _job_store() -> dist.Store | None:
    """The job's key-value store; None outside a process group, and in a dry run's fake
    world (train/start/dryrun.py), whose peers do not exist: rank 0 agrees with itself."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    return dist.distributed_c10d._get_default_store()
