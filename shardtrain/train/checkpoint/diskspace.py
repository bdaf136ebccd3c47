"""A failed checkpoint save -- a full disk, or any other error of a rank's write or of the
main rank's commit -- handled the same way on every rank.

Before each save the ranks add up the bytes they are about to write (known from the state:
each piece's size, each own-state file's tensors) and the main rank compares the sum with
the free space of the checkpoint directory. When a write still fails (ENOSPC because
another process filled the disk or the estimate was short, EIO, anything else), every rank
learns it at the end of that write (train/checkpoint/agree.py), the main rank removes the
staging directory, and all of them raise the same error: `DiskFull` for a full disk,
`SaveFailed` otherwise. The run stops with one message on the main rank, naming the
directory, the failing rank and cause (for a full disk the bytes needed and free), the last
good checkpoint, and the fixes. Before this (issues 34 and 39) the failing rank ended in a
traceback, its peers in a collective timeout, and the staging directory kept the space it
had taken.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from shardtrain.train.checkpoint.agree import EXIT_CODE, Agreement, SaveFailed, describe

__all__ = ["EXIT_CODE", "DiskFull", "SaveFailed", "SpaceGuard", "state_bytes"]

MARGIN_BYTES = 1 << 16  # safetensors headers, indexes, manifest, meta.json, config.toml
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(SaveFailed):
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


def _full_code(text: str) -> int | None:
    """The errno of a full disk in an agreed error (OSError's "[Errno N] ..."), else None."""
    return next((code for code in _FULL if text.startswith(f"[Errno {code}]")), None)


def _free_bytes(directory: Path) -> int:
    existing = directory
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


class SpaceGuard:
    """One per Saver; every method is called by every rank at the same point of a save
    (on an asynchronous save's thread for the write and the commit)."""

    def __init__(self, root: Path, *, rank: int, world_size: int, keep: int,
                 last_good: Path | None):
        """`last_good`: the run's last good checkpoint (the Saver keeps it up to date)."""
        self.root, self.rank, self.keep, self.last_good = root, rank, keep, last_good
        self.agreement = Agreement("save", rank, world_size)

    def _kept(self) -> str:
        last = self.last_good
        return f"the last good checkpoint, {last}, is intact" if last else \
            "no checkpoint was written yet"

    def _advice(self) -> str:
        return (f"{self._kept()}; free space on that filesystem (older checkpoints there can "
                f"go), lower checkpoint.keep (now {self.keep}: a save needs room for one more "
                "before it removes the oldest), or give another train.run_dir")

    def check(self, step: int, own_bytes: int) -> None:
        """Before writing: the sum of every rank's bytes fits in the free space."""
        needed = self.agreement.total(own_bytes)
        verdict = ""
        if self.rank == 0:
            free = _free_bytes(self.root)
            if needed + MARGIN_BYTES > free:
                verdict = (f"checkpoint of step {step} not written: {self.root} needs "
                           f"{needed + MARGIN_BYTES:,} bytes and has {free:,} free; "
                           + self._advice())
        refused = self.agreement.outcome(verdict)  # the main rank's verdict, on every rank
        if refused:
            raise DiskFull(refused.error)

    def agree(self, step: int, phase: str, error: BaseException | None,
              clean_up: Callable[[], None]) -> None:
        """After a phase of the save ("write": every rank's files; "commit": the main
        rank's), each rank's `error` or None: if any rank failed, the main rank removes the
        staging directory and every rank raises the same error."""
        failed = self.agreement.outcome(describe(error) if error is not None else "")
        if not failed:
            return
        if self.rank == 0:
            clean_up()
        code = _full_code(failed.error)
        if code is not None:
            raise DiskFull(f"checkpoint of step {step} not written: {os.strerror(code)} in "
                           f"{self.root} (on {failed.failed} rank(s), rank {failed.rank} among "
                           "them); its staging directory was removed; " + self._advice()) \
                from error
        did = "could not commit it" if phase == "commit" else "could not write its part"
        more = f"; on {failed.failed} rank(s) in all" if failed.failed > 1 else ""
        raise SaveFailed(f"checkpoint of step {step} not written: rank {failed.rank} {did} "
                         f"({failed.error}){more}; its staging directory was removed; "
                         f"{self._kept()}; fix the cause, then resume with "
                         "--checkpoint.resume latest") from error
