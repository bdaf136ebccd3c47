"""Threads and GPU 0 (comm/threads.py), checked on a CPU with torch.cuda's current-device
calls mocked per thread, as CUDA keeps them (a new thread's device is 0): the hang
watchdog and the asynchronous checkpoint writer run with their rank's GPU current; a save
of CPU tensors touches no GPU even where one exists; and the watchdog's poll
survives the waiting thread clearing an entry's work between two reads."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from parity import tiny
from shardtrain.ckpt import dcp
from shardtrain.ckpt.files import Piece
from shardtrain.ckpt.regions import block_region
from shardtrain.comm import build_mesh
from shardtrain.comm.flight import Entry, FlightRecorder
from shardtrain.comm.threads import device_thread
from shardtrain.comm.watchdog import Watchdog
from shardtrain.mesh import MeshShape
from shardtrain.train.checkpoint.saver import Saver


@pytest.fixture
def gpus(monkeypatch) -> list[int]:
    """CUDA's per-thread current device, mocked; returns the set_device calls."""
    local, calls = threading.local(), []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: (
        calls.append(index), setattr(local, "index", index)))
    return calls


def _piece() -> Piece:
    return Piece(block_region("model/w", (4,), ((0, 4),)), torch.float32,
                 lambda: torch.arange(4.0))


def test_a_thread_runs_on_the_device_it_is_given_or_its_starters(gpus):
    seen = []
    torch.cuda.set_device(3)  # as shardtrain.launch does for the rank (local rank 3)
    for device in (None, torch.device("cuda", 2), torch.device("cuda"), torch.device("cpu")):
        thread = device_thread(lambda: seen.append(torch.cuda.current_device()), name="t",
                               device=device)
        thread.start()
        thread.join()
    assert seen == [3, 2, 3, 0] and gpus == [3, 3, 2, 3]  # a CPU device: nothing made current


def test_the_watchdog_polls_on_its_ranks_gpu(gpus, tmp_path):
    seen = []
    recorder = SimpleNamespace(poll=lambda: seen.append(torch.cuda.current_device()),
                               published=lambda waiting=None: "{}")
    store = SimpleNamespace(set=lambda key, value: None, check=lambda keys: False)
    torch.cuda.set_device(1)
    dog = Watchdog(recorder, store, rank=1, world_size=2, timeout_s=60, run_dir=tmp_path,
                   interval=0.01).start()
    while not seen:
        time.sleep(0.01)
    dog.stop()
    assert set(seen) == {1}


def test_the_async_checkpoint_writer_runs_on_the_ranks_gpu(gpus, tmp_path, monkeypatch):
    """The writer thread (DCP's loader takes the current stream there) has the mesh's
    device current; a world of one on CPU, its device said to be cuda:1."""
    cfg = tiny(tmp_path, "run", "--checkpoint.async_save", "true")
    mesh = build_mesh(MeshShape(), device=torch.device("cpu"))
    saver = Saver(cfg, mesh)
    mesh.device = torch.device("cuda", 1)  # read by the saver for its thread alone
    seen, write = [], dcp.SavePlanned.write
    monkeypatch.setattr(dcp.SavePlanned, "write", lambda self, sums=None: (
        seen.append(torch.cuda.current_device()), write(self, sums)))
    parallel = SimpleNamespace(state_pieces=lambda: ([_piece()], {}),
                               optimizer_files=lambda is_main: {})
    saver.save(2, parallel, sampler_state={}, layout={"zero": 0, "dp": 1, "tp": 1},
               tokenizer_file=None)
    saver.wait()
    assert seen == [1] and saver.committed.name.endswith("2")


@pytest.mark.parametrize("device", [None, torch.device("cpu")])
def test_a_cpu_save_touches_no_gpu_where_one_exists(tmp_path, monkeypatch, device):
    """Neither the staging (its buffers' events, pinned memory) nor the writers touch a
    GPU for values on the host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def touched(*args, **kwargs):
        raise AssertionError("a save of CPU tensors touched a GPU (a context on GPU 0)")
    monkeypatch.setattr(torch.cuda, "Event", touched)
    monkeypatch.setattr(torch.cuda, "current_stream", touched)
    for staged_first in (True, False):
        (tmp_path / str(staged_first)).mkdir()
        planned = dcp.plan_save(tmp_path / str(staged_first), 0, [_piece()],
                                lambda plain: [plain], *([device] if device else []))
        if staged_first:
            planned.start()
        planned.write()
        assert planned.staged_peak > 0


class _Cleared(Entry):
    """An entry whose work the waiting thread clears right after another thread's first
    read of it (the interleaving a race can produce)."""

    @property
    def work(self):
        work, self.held = getattr(self, "held", None), None
        return work

    @work.setter
    def work(self, value):
        self.held = value


class _Finished:
    """A backend work that finished well."""

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


@pytest.mark.parametrize("reader", ["poll", "complete"])
def test_a_work_cleared_between_two_reads_breaks_nothing(reader):
    """Both readers of an entry's work (the watchdog's poll, the waiting thread's complete)
    read it once: a second read may find None, and an AttributeError in the watchdog's
    thread would end it silently."""
    rec = FlightRecorder()
    entry = _Cleared(group="dp", key="dp@0", op="all_reduce", seq=1, ranks=(0, 1),
                     streamed=True)
    entry.work = _Finished()
    rec.pending[id(entry)] = entry
    assert (rec.poll() if reader == "poll" else rec.complete(entry)) is None
    assert entry.state == "completed" and not rec.pending
