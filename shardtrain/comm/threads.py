"""Threads that may touch a GPU run with their rank's device current.

CUDA's current device belongs to a thread, and a new thread's is device 0, whatever its
process set with torch.cuda.set_device. Whatever such a thread does without naming a
device -- take a current stream, record an event, wait on a CUDA future -- happens on GPU
0, and its first CUDA call creates a context there (hundreds of MiB): from every rank of a
node, all on its first GPU. The threads that do it: the hang watchdog polling NCCL works
(comm/watchdog.py, flight.py), the asynchronous checkpoint writer (DCP's loader takes the
current stream: train/checkpoint/saver.py), a parameter-server worker's puller (its copies
into the parameters: parallel/ps/worker.py). Each is started through `device_thread`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def device_thread(target: Callable[[], None], *, name: str,
                  device: torch.device | None = None) -> threading.Thread:
    """A daemon thread (not started) that makes `device` current, then runs `target`.
    `device`: a CUDA device (without an index: the caller's current one); a CPU or meta
    device: nothing to make current; None: the CUDA device current in the calling thread
    if CUDA is initialised (shardtrain.launch sets each rank's before anything starts)."""
    index = _cuda_index(device)

    def run() -> None:
        if index is not None:
            torch.cuda.set_device(index)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def _cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device index to make current in the new thread (read in the caller's)."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index
