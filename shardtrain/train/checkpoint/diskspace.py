"""A full disk during a checkpoint: checked before the save, handled the same way on every
rank when a write fails anyway.

Before each save the ranks add up the bytes they are about to write (known from the state:
each piece's size, each own-state file's tensors) and the main rank compares the sum with
the free space of the checkpoint directory. When a write still fails with ENOSPC (another
process filled the disk, or the estimate was short), every rank learns it at the next
meeting point, the main rank removes the staging directory, and all of them raise
`DiskFull`: the run stops with one message on the main rank, naming the directory, the
bytes needed and free, the last good checkpoint, and the fixes. Before this (issue 34) the
failing rank ended in a traceback, its peers in a collective timeout, and the staging
directory kept the space it had taken.

The ranks agree through the job's key-value store (a counter per save, the main rank's
decision as a value), not through collectives: the communication ledger is unchanged.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MARGIN_BYTES = 1 << 16  # safetensors headers, indexes, manifest, meta.json, config.toml
EXIT_CODE = 74  # sysexits.h EX_IOERR: the run stopped on an I/O error (not a bad input: 2)


class DiskFull(Exception):
    """The checkpoint does not fit: stop training; the message is for the main rank."""


def state_bytes(sizes: Iterable[int], files: dict[str, Any]) -> int:
    """Bytes a rank writes: its pieces' sizes plus the tensors in its own state files."""
    total = sum(sizes)
    for state in files.values():
        stack = [state]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
    return total


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(directory: Path) -> int:
    existing = directory
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


class SpaceGuard:
    """One per Saver; every method is called by every rank at the same point of a save."""

    def __init__(self, root: Path, *, rank: int, world_size: int, keep: int,
                 last_good: Callable[[], Path | None]):
        self.root, self.rank, self.keep, self.last_good = root, rank, keep, last_good
        self.store = dist.distributed_c10d._get_default_store() if world_size > 1 else None

    def _advice(self) -> str:
        last = self.last_good()
        kept = f"the last good checkpoint, {last}, is intact" if last else \
            "no checkpoint was written yet"
        return (f"{kept}; free space on that filesystem (older checkpoints there can go), "
                f"lower checkpoint.keep (now {self.keep}: a save needs room for one more before "
                "it removes the oldest), or give another train.run_dir")

    def check(self, step: int, own_bytes: int, barrier: Callable[[], None]) -> None:
        """Before writing: the sum of every rank's bytes fits in the free space."""
        needed = self._sum(f"shardtrain/ckpt/{step}/bytes", own_bytes, barrier)
        verdict = ""
        if self.rank == 0:
            free = _free_bytes(self.root)
            if needed + MARGIN_BYTES > free:
                verdict = (f"checkpoint of step {step} not written: {self.root} needs "
                           f"{needed + MARGIN_BYTES:,} bytes and has {free:,} free; "
                           + self._advice())
        verdict = self._share(f"shardtrain/ckpt/{step}/space", verdict)
        if verdict:
            raise DiskFull(verdict)

    def agree(self, step: int, phase: str, error: BaseException | None,
              barrier: Callable[[], None], clean_up: Callable[[], None]) -> None:
        """After a write phase (each rank's `error`: None, or its ENOSPC): if any rank
        failed, the main rank removes the staging directory and every rank raises."""
        if error is not None and not is_disk_full(error):
            raise error
        failed = self._sum(f"shardtrain/ckpt/{step}/{phase}", int(error is not None), barrier)
        if not failed:
            return
        if self.rank == 0:
            clean_up()
        reason = f"{error.strerror}" if error is not None else "no space left on device"
        raise DiskFull(f"checkpoint of step {step} not written: {reason} in {self.root} "
                       f"(on {failed} rank(s)); its staging directory was removed; "
                       + self._advice())

    def _sum(self, key: str, value: int, barrier: Callable[[], None]) -> int:
        """Every rank's `value` added up (the barrier: every rank has added its own)."""
        if self.store is None:
            return value
        self.store.add(key, value)
        barrier()
        return self.store.add(key, 0)

    def _share(self, key: str, verdict: str) -> str:
        """The main rank's verdict, on every rank ("": go on)."""
        if self.store is None:
            return verdict
        if self.rank == 0:
            self.store.set(key, verdict or "ok")
            return verdict
        value = self.store.get(key).decode()  # waits for the main rank's
        return "" if value == "ok" else value
