"""Build-once files shared by processes: an flock so one builds, an atomic rename to publish."""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from shardtrain.config import ConfigError

_POLL_S = 0.2  # how often a waiter tries the lock again


def build_once(target: Path, build: Callable[[Path], None], *, timeout_s: float) -> bool:
    """Create `target` by `build(tmp_path)` unless it exists; True when this call built it.

    Concurrent callers (the ranks of one machine, other runs sharing data.cache_dir)
    serialise on `<target>.lock`: the first builds, the others wait, see the file and return.
    The builder writes its PID into the lock file; a waiter prints one line naming the file
    and that PID, and gives up after `timeout_s` (data.lock_timeout_s) with an error naming
    the file. Readers never see a partial file: it appears only through `os.replace` of a
    finished temp file.
    """
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    # "a+", not "w": opening must not truncate the PID the holder wrote.
    with open(lock_path, "a+") as lock:  # the flock is released when the file closes
        _acquire(lock, lock_path, target, timeout_s)
        try:
            lock.truncate(0)
            lock.write(f"{os.getpid()} {socket.gethostname()}\n")
            lock.flush()
            if target.exists():
                return False
            _build(target, build)
        finally:
            lock.truncate(0)  # the PID leaves with the lock: no waiter reads a stale one
    return True


def _build(target: Path, build: Callable[[Path], None]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        build(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        usual_mode(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _acquire(lock: IO[str], lock_path: Path, target: Path, timeout_s: float) -> None:
    """Take the lock; while another process holds it, say so once, and raise a ConfigError
    after `timeout_s`. Polled, not a blocking flock: a blocking one cannot time out, and a
    stuck holder then hangs every run on the machine without a word (issue 39)."""
    start = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        holder = _holder(lock_path)
        # The holder writes its PID just after it takes the lock: allow it a second.
        if not told and (holder != "an unknown process" or waited >= min(1.0, timeout_s)):
            print(f"shardtrain: waiting for {lock_path}, held by {holder} building "
                  f"{target.name} (giving up after data.lock_timeout_s={timeout_s:g} s)",
                  file=sys.stderr, flush=True)
            told = True
        if waited >= timeout_s:
            raise ConfigError(
                f"{lock_path}: still held by {holder} after data.lock_timeout_s={timeout_s:g} "
                f"s, building {target}; if that process is stuck, stop it and run again; if "
                "it is still building a large cache, raise data.lock_timeout_s")
        time.sleep(min(_POLL_S, max(timeout_s - waited, 0.0)))


def _holder(lock_path: Path) -> str:
    """'PID 123 on host' as the lock file says, or 'an unknown process'."""
    try:
        pid, _, host = lock_path.read_text().strip().partition(" ")
    except OSError:
        pid = host = ""
    if not pid.isdigit():
        return "an unknown process"
    return f"PID {pid}" + (f" on {host}" if host else "")


def usual_mode(path: Path) -> None:
    """Give `path` the mode a plain open() gives a new file, 0666 less the umask: mkstemp
    and safetensors create theirs 0600, unreadable to the user's group."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed into place: a reader (or a
    crash) never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
