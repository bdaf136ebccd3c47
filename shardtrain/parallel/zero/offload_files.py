"""ZeRO-Infinity's state directory: its checks before launch, each rank's own folder, and
the removal of the folders a killed attempt left behind.

Each rank keeps its state files in a folder of its own under `parallel.offload_dir`,
named after the host and the process that owns it: shardtrain-<host>-pid<pid>-rank<r>-<random>.
A run that ends removes its folder (HostOptimizer's finalizer); a killed process cannot, so
every new attempt first removes the folders of processes that no longer exist, then checks
the free space (the stale files would otherwise count against it). Several ranks, and
several jobs, may share the directory: only folders of this host whose process is dead
are removed, never a live one's, whatever run it belongs to.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from shardtrain.config import Config, ConfigError, OptimConfig
from shardtrain.cost.counts import param_counts
from shardtrain.parallel.zero.optim import moment_names

# mkdtemp's random suffix is [a-z0-9_]; the host name may hold '-', so the pid anchors it.
_FOLDER = re.compile(r"shardtrain-(?P<host>.+)-pid(?P<pid>\d+)-rank\d+-[a-z0-9_]+")


def state_names(optim: OptimConfig) -> tuple[str, ...]:
    """The fp32 tensors kept per parameter element: the master weight, then the moments."""
    return ("master", *moment_names(optim))


def offload_bytes(numel: int, optim: OptimConfig) -> int:
    """Bytes of host (cpu) or file (nvme) state for `numel` fp32 master elements."""
    return 4 * numel * len(state_names(optim))


def check_offload_space(cfg: Config) -> None:
    """Before launch (train/start/prepare.py prepare_run): with nvme offload, the directory must hold every
    rank's state files, (1 + moments) x 4 bytes per parameter in all."""
    if cfg.parallel.offload == "nvme":
        check_offload_dir(cfg.parallel.offload_dir,
                          offload_bytes(param_counts(cfg.model).total, cfg.optim))


def check_offload_dir(directory: str, needed_bytes: int) -> None:
    """nvme offload: the directory must exist, be writable, and, once the folders of dead
    processes are gone (remove_stale_folders), have room for the state of every rank that
    shares it (`needed_bytes`). ConfigError naming the field otherwise."""
    field = f"parallel.offload_dir={directory!r}"
    if not directory:
        raise ConfigError("parallel.offload=nvme needs parallel.offload_dir: a directory on a "
                          "fast local disk for the optimizer state files")
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"{field} does not exist; create it (mkdir -p) or point "
                          "parallel.offload_dir at an existing directory")
    try:  # a real write: permission bits say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"{field} is not writable ({e.strerror}); choose a directory you "
                          "can write to") from None
    remove_stale_folders(path)
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ConfigError(
            f"{field} has {free / 2**20:.1f} MiB free, but the offloaded optimizer state "
            f"needs {needed_bytes / 2**20:.1f} MiB; free space there or choose a larger disk")


def make_state_folder(directory: str, rank: int) -> Path:
    """This process's own folder for rank `rank`'s state files (module docstring)."""
    prefix = f"shardtrain-{socket.gethostname()}-pid{os.getpid()}-rank{rank}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=directory))


def remove_stale_folders(directory: Path) -> list[Path]:
    """Remove the state folders under `directory` of this host's processes that are gone
    (killed before their finalizer ran); return them. Folders of other hosts, of live
    processes and anything not named as make_state_folder names are left alone."""
    host, removed = socket.gethostname(), []
    for entry in directory.iterdir():
        m = _FOLDER.fullmatch(entry.name)
        if m is None or m["host"] != host or not entry.is_dir() or _alive(int(m["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True)  # another rank may be removing it too
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed rank its launcher has not
    reaped yet holds no files open: its folder is stale). A pid reused by an unrelated
    process reads as alive: its folder is kept, never a live one removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # /proc/<pid>/stat: "pid (comm) state ..."; comm may hold spaces and parentheses
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
