"""Build-once files shared by processes: an flock so one builds, an atomic rename to publish."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(target: Path, build: Callable[[Path], None]) -> bool:
    """Create `target` by `build(tmp_path)` unless it exists; True when this call built it.

    Concurrent callers (the ranks of one machine) serialise on `<target>.lock`: the first
    builds, the others wait, see the file and return. Readers never see a partial file
    because it appears only through `os.replace` of a finished temp file.
    """
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():
            return False
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
    return True


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
