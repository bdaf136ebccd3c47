"""Writing one rank's stored chunks: a bounded staging pool feeding parallel file writers.

The rank's chunks (in its save plan's order) are split into at most `WRITERS` runs of
about equal bytes, one DCP data file each (`__<rank>_<j>.distcp`), each written and
fsynced by its own thread. A single stager (the calling thread: `Staged.start`) copies
the chunks' values, part by part, into reusable buffers of a pool of `budget` bytes
(`checkpoint.staging_mb`; pinned host memory where the values live on a GPU, each
buffer's copies awaited by its writer through an event) and hands each filled buffer to
its file's writer, which frames each chunk (frames.py: the bytes `torch.save` would write,
as DCP's reader loads them), computes its CRC-32 as the bytes go out, and gives the
buffer back. The stager waits for a free buffer when all are in flight: at no moment are
more than `budget` bytes staged (`peak` counts them), whatever the rank's share, and a
chunk larger than a buffer goes in several parts.

Why threads: `write`, `fsync` and `zlib.crc32` release the GIL, so the copy, the CRC and
two files' writes overlap; on the 2-core machine two fsynced files in parallel wrote
~1.4x one file's bandwidth (docs/checkpoints.md). A rank writing less than `SPLIT_BYTES`
keeps one file (each costs an fsync and a thread).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from shardtrain.ckpt.frames import frame, parts

WRITERS = 2  # data files (and writer threads) per rank, at most
SPLIT_BYTES = 64 << 20  # a rank's bytes per extra file, at least
BLOCK_BYTES = 8 << 20  # one staging buffer, at most
ALIGN = 64  # a part's place in a buffer (a view of any dtype needs an aligned offset)


@dataclass(frozen=True)
class Item:
    index: MetadataIndex
    dtype: torch.dtype
    shape: tuple[int, ...]  # the stored chunk's sizes
    nbytes: int


class Pool:
    """Reusable staging buffers, `budget` bytes in all (one buffer at least)."""

    def __init__(self, budget: int, pinned: bool):
        self.block = max(ALIGN, min(budget, BLOCK_BYTES))
        self.free: queue.Queue = queue.Queue()
        for _ in range(max(1, budget // self.block)):
            self.free.put(torch.empty(self.block, dtype=torch.uint8, pin_memory=pinned))
        self.failed = threading.Event()
        self._lock = threading.Lock()
        self.held = self.peak = 0  # bytes staged and not yet written: now, at most

    def take(self) -> torch.Tensor:
        while True:  # a writer that failed gives nothing back: stop waiting then
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                if self.failed.is_set():
                    raise RuntimeError("a checkpoint writer failed") from None

    def staged(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def give_back(self, buffer: torch.Tensor, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
        self.free.put(buffer)


class _Writer(threading.Thread):
    """One data file: each batch (a filled buffer's ops) framed, summed, written; fsynced."""

    def __init__(self, directory: Path, name: str, pool: Pool):
        super().__init__(name=f"checkpoint-writer-{name}", daemon=True)
        self.path, self.name, self.pool = Path(directory) / name, name, pool
        self.batches: queue.Queue = queue.Queue()
        self.results: list[WriteResult] = []
        self.sums: dict[str, str] = {}  # "file:offset" -> the stored chunk's CRC-32
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with open(self.path, "wb", buffering=1 << 20) as f:
                at = crc = 0
                while (batch := self.batches.get()) is not None:
                    buffer, used, copied, ops = batch
                    if copied is not None:
                        copied.synchronize()  # the buffer's device-to-host copies
                    for op, arg in ops:
                        if op == "begin":  # arg: the Item
                            at, header = f.tell(), frame(arg.dtype, arg.shape).header
                            f.write(header)
                            crc = zlib.crc32(header)
                        elif op == "data":  # arg: a memoryview into the buffer
                            f.write(arg)
                            crc = zlib.crc32(arg, crc)
                        else:  # "end"
                            trailer = frame(arg.dtype, arg.shape).trailer
                            f.write(trailer)
                            crc = zlib.crc32(trailer, crc)
                            length = f.tell() - at
                            self.results.append(WriteResult(
                                index=arg.index, size_in_bytes=length,
                                storage_data=_StorageInfo(self.name, at, length)))
                            self.sums[f"{self.name}:{at}"] = f"{crc:08x}"
                    if buffer is not None:
                        self.pool.give_back(buffer, used)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:  # raised by `Staged.wait`, on the caller's thread
            self.error = e
            self.pool.failed.set()


def split(items: list[Item], nbytes: int) -> list[list[Item]]:
    """`items` in order as at most WRITERS runs of about equal bytes (one per data file)."""
    files = max(1, min(WRITERS, nbytes // SPLIT_BYTES))
    runs: list[list[Item]] = [[]]
    done = 0
    for item in items:
        if done >= len(runs) * nbytes / files and len(runs) < files:
            runs.append([])
        runs[-1].append(item)
        done += item.nbytes
    return runs


class Staged:
    """A rank's write in flight: `start` stages every chunk (the writers still writing),
    `wait` until every file is written and fsynced."""

    def __init__(self, directory: Path, prefix: str, runs: list[list[Item]], budget: int,
                 pinned: bool):
        self.runs, self.pool = runs, Pool(budget, pinned)
        self.writers = [_Writer(directory, f"{prefix}{j}{DEFAULT_SUFFIX}", self.pool)
                        for j in range(len(runs))]

    def start(self, values) -> None:
        """Stage every chunk: `values(item)` its values [item.shape], on any device."""
        for w in self.writers:
            w.start()
        try:
            for writer, run in zip(self.writers, self.runs):
                self._stage_run(writer, run, values)
        except BaseException:
            failed = [w.error for w in self.writers if w.error is not None]
            if failed:  # the cause (a full disk...), not the stager's wait it ended
                raise failed[0] from None
            raise
        finally:  # the writers end after what was staged (or at once: a stager's error)
            for w in self.writers:
                w.batches.put(None)

    def _stage_run(self, writer: _Writer, run: list[Item], values) -> None:
        buffer, used, ops, cuda = None, 0, [], None

        def flush() -> None:
            nonlocal buffer, used, ops, cuda
            copied = None
            if cuda is not None:  # the copies were queued on the device's current stream
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(cuda))
            writer.batches.put((buffer, used, copied, ops))
            buffer, used, ops, cuda = None, 0, [], None

        limit = self.pool.block  # bytes of one part, at most
        for item in run:
            ops.append(("begin", item))
            chunk = values(item)  # [item.shape]: numpy integers (host) or a tensor
            size = item.dtype.itemsize
            for part in parts(chunk, max(1, limit // size)):
                n = math.prod(part.shape) * size
                if buffer is None or used + n > self.pool.block:
                    if buffer is not None:
                        flush()
                    buffer = self.pool.take()
                    bits = buffer.numpy()  # the same bytes: numpy's copies are cheaper
                if isinstance(part, np.ndarray):
                    np.copyto(bits[used:used + n].view(part.dtype).reshape(part.shape), part)
                else:  # on a device (or converted): torch's copy, asynchronous from a GPU
                    host = buffer[used:used + n].view(item.dtype).view(part.shape)
                    host.copy_(part, non_blocking=part.is_cuda)
                    cuda = part.device if part.is_cuda else cuda
                ops.append(("data", memoryview(bits[used:used + n])))
                step = -(-n // ALIGN) * ALIGN
                self.pool.staged(step)
                used += step
            ops.append(("end", item))
        if buffer is not None or ops:
            flush()

    def wait(self) -> tuple[list[WriteResult], dict[str, str]]:
        """Every file written and fsynced: the write results and CRC-32s; a writer's
        error, if one failed."""
        for w in self.writers:
            w.join()
        for w in self.writers:
            if w.error is not None:
                raise w.error
        return ([r for w in self.writers for r in w.results],
                {k: v for w in self.writers for k, v in w.sums.items()})
