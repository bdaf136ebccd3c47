"""Writing one rank's stored chunks: a bounded staging pool feeding parallel file writers.

The rank's chunks (in its save plan's order) are split into at most `WRITERS` runs of
about equal bytes, one DCP data file each (`__<rank>_<j>.distcp`), each chunk's byte
offset fixed when the save is planned (`place`: a framed chunk's length depends only on
its dtype and shape), each file written and fsynced by its own thread. A single stager
(the calling thread: `Staged.start`) copies the chunks' values, part by part, into
reusable buffers of a pool of `budget` bytes (`checkpoint.staging_mb`; pinned host memory
where the values live on a GPU, each buffer's copies awaited by its writer through an
event) and hands each filled buffer to its file's writer, which frames each chunk
(frames.py: the bytes `torch.save` would write, as DCP's reader loads them), computes its
CRC-32 as the bytes go out, writes the whole buffer's frames and values with one
`os.writev` (a buffer holds up to hundreds of small chunks: one syscall, not three per
chunk), checks each chunk lands at its planned offset, and gives the buffer back. The
stager waits for a free buffer when all are in flight: at no moment are more than
`budget` bytes staged (`peak` counts them), whatever the rank's share, and a chunk larger
than a buffer goes in several parts.

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
from torch.distributed.checkpoint.metadata import MetadataIndex

from shardtrain.ckpt.frames import frame, parts

WRITERS = 2  # data files (and writer threads) per rank, at most
SPLIT_BYTES = 64 << 20  # a rank's bytes per extra file, at least
BLOCK_BYTES = 8 << 20  # one staging buffer, at most
ALIGN = 64  # a part's place in a buffer (a view of any dtype needs an aligned offset)
IOV_MAX = 1024  # byte ranges per os.writev, at most (Linux's limit)


@dataclass(frozen=True)
class Item:
    index: MetadataIndex
    dtype: torch.dtype
    shape: tuple[int, ...]  # the stored chunk's sizes
    nbytes: int  # its values'
    offset: int = 0  # where its frame starts in its data file (`place`)

    @property
    def stored(self) -> int:
        """Its bytes in the file: the values, framed."""
        return self.nbytes + frame(self.dtype, self.shape).nbytes


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
    """One data file: each batch (a filled buffer's ops) framed, summed and written with
    one `os.writev`, each chunk at its planned offset; fsynced."""

    def __init__(self, directory: Path, name: str, pool: Pool):
        super().__init__(name=f"checkpoint-writer-{name}", daemon=True)
        self.path, self.name, self.pool = Path(directory) / name, name, pool
        self.batches: queue.Queue = queue.Queue()
        self.sums: dict[str, str] = {}  # "file:offset" -> the stored chunk's CRC-32
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self._write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as e:  # raised by `Staged.wait`, on the caller's thread
            self.error = e
            self.pool.failed.set()

    def _write(self, fd: int) -> None:
        at = crc = 0  # the file's length so far; the current chunk's CRC-32
        while (batch := self.batches.get()) is not None:
            buffer, used, copied, ops = batch
            if copied is not None:
                copied.synchronize()  # the buffer's device-to-host copies
            out: list = []  # byte ranges to write: frames and views into the buffer
            for op, arg in ops:
                if op == "begin":  # arg: the Item
                    if arg.offset != at:
                        raise RuntimeError(f"{self.path}: chunk {arg.index.fqn} at byte {at}, "
                                           f"planned at {arg.offset}")
                    data = frame(arg.dtype, arg.shape).header
                    crc = zlib.crc32(data)
                elif op == "data":  # arg: a memoryview into the buffer
                    data = arg
                    crc = zlib.crc32(data, crc)
                else:  # "end"
                    data = frame(arg.dtype, arg.shape).trailer
                    crc = zlib.crc32(data, crc)
                    self.sums[f"{self.name}:{arg.offset}"] = f"{crc:08x}"
                out.append(data)
                at += len(data)
            _write_all(fd, out)
            if buffer is not None:
                self.pool.give_back(buffer, used)


def _write_all(fd: int, ranges: list) -> None:
    """Every byte of `ranges` appended to `fd`, IOV_MAX ranges per os.writev (which may
    write less than asked: the rest is written again)."""
    for at in range(0, len(ranges), IOV_MAX):
        batch = [memoryview(r).cast("B") for r in ranges[at:at + IOV_MAX]]
        while batch:
            n = os.writev(fd, batch)
            while batch and n >= batch[0].nbytes:
                n -= batch[0].nbytes
                batch.pop(0)
            if batch and n:
                batch[0] = batch[0][n:]


def place(items: list[Item]) -> list[list[Item]]:
    """`items` in order as at most WRITERS runs of about equal bytes (one per data file),
    each item at its byte offset in its file."""
    nbytes = sum(item.nbytes for item in items)
    files = max(1, min(WRITERS, nbytes // SPLIT_BYTES))
    runs: list[list[Item]] = [[]]
    done = at = 0
    for item in items:
        if done >= len(runs) * nbytes / files and len(runs) < files:
            runs.append([])
            at = 0
        runs[-1].append(Item(item.index, item.dtype, item.shape, item.nbytes, at))
        done += item.nbytes
        at += runs[-1][-1].stored
    return runs


class Staged:
    """A rank's write in flight: `start` stages every chunk (the writers still writing),
    `wait` until every file is written and fsynced."""

    def __init__(self, directory: Path, files: list[tuple[str, list[Item]]], budget: int,
                 pinned: bool):
        self.runs, self.pool = [run for _, run in files], Pool(budget, pinned)
        self.writers = [_Writer(directory, name, self.pool) for name, _ in files]

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

    def wait(self) -> dict[str, str]:
        """Every file written and fsynced: the stored chunks' CRC-32s; a writer's error,
        if one failed."""
        for w in self.writers:
            w.join()
        for w in self.writers:
            if w.error is not None:
                raise w.error
        return {k: v for w in self.writers for k, v in w.sums.items()}
