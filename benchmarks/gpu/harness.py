"""One process on one device: what the GPU check's parts (benchmarks/gpu/*.py) and the tests
of tests/gpu share.

A trainer here is built as `shardtrain train` builds a one-process run
(shardtrain.launch.run_worker): its mesh comes from shardtrain.comm.build_mesh with the
run's device, so every communicator's payload lives there. (A ParallelMesh built with no
device is a CPU mesh at world size 1, and a CUDA run's first gradient bucket is refused:
comm/dispatch.py `placed`.)

Rows: each check the GPU script makes is one JSON line {"part", "name", "ok", "error", ...
figures} appended to a rows file (report.py turns them into the table). `guarded` runs one
check and writes its row whatever happens, so one failure costs one row, not the part.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock
from typing import Any

import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.config import Config
from shardtrain.launch import ProcessInfo, pick_device
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer

MIB = 2**20
# torch.compile's backend per device: inductor's kernels on a GPU; on a CPU twin dynamo and
# AOT autograd without code generation (inductor's C++ compile takes minutes cold on a busy
# 2-core machine; tests/test_compile.py checks inductor's CPU kernels).
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}


def device_of(name: str) -> torch.device:
    """"cuda": the GPU a one-process run takes (shardtrain.launch.pick_device, which also
    makes it current); "cpu": the CPU twin of a GPU check, on one thread as the test suite
    runs (tiny models on two threads spend most of their time in thread hand-offs on a busy
    machine)."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu "
                             "(the CPU twins: benchmarks/gpu/check.sh --dry-run)")
        return pick_device("cuda", ProcessInfo())
    torch.set_num_threads(1)
    return torch.device("cpu")


def part_main(doc: str, part: str, *, cache: bool = False,
              more: Callable[[argparse.ArgumentParser], None] | None = None
              ) -> tuple[torch.device, Rows, argparse.Namespace]:
    """The command line every part of check.sh takes: --device (cuda, or cpu: its twin),
    --rows (the JSON-lines file its rows go to), --cache (the token cache, where the part
    trains); `more` adds a part's own options. Returns the device, the part's Rows, the args."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", required=True, help="the JSON-lines file the rows go to")
    if cache:
        p.add_argument("--cache", default=None, help="token cache directory")
    if more is not None:
        more(p)
    args = p.parse_args()
    return device_of(args.device), Rows(args.rows, part), args


def run_config(preset: str, run_dir: Path, device: torch.device, *overrides: str,
               cache_dir: str | None = None) -> Config:
    """`preset` with its run dir, quiet, on `device`. On the CPU the MFU's peak is given, not
    measured (a CPU twin's MFU is no figure). `cache_dir`: the token cache (None: the
    config's)."""
    extra = ["--data.cache_dir", str(cache_dir)] if cache_dir else []
    if device.type == "cpu":
        extra += ["--train.peak_flops", "1e12"]
    return config.load(preset, ["--train.run_dir", str(run_dir), "--train.progress", "false",
                                "--train.device", device.type, *extra, *overrides])


def one_process(cfg: Config, device: torch.device) -> Trainer:
    """A one-process trainer of `cfg` on `device`, its mesh on the same device."""
    cfg.validate(1)
    mesh = build_mesh(MeshShape(), device=device, algorithm=cfg.comm.algorithm,
                      timeout_s=cfg.comm.timeout_s)
    assert mesh.comm("dp").device.type == device.type, (mesh.comm("dp").device, device)
    return Trainer(cfg, mesh, device)


@contextlib.contextmanager
def compile_backend(device: torch.device) -> Iterator[str]:
    """train.compile's torch.compile calls made with COMPILE_BACKEND[device.type]."""
    backend = COMPILE_BACKEND[device.type]
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=backend)):
        yield backend


def figures(history: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figures for a row: last loss, median step time of the second half (warmed
    up), MFU, peak memory allocated and reserved (MiB; reserved is None on a CPU)."""
    last = history[-1]
    times = [r["step_time_s"] for r in history[len(history) // 2:]]
    reserved = last.get("peak_reserved_bytes")
    return {"loss": last["loss"], "ms_per_step": statistics.median(times) * 1e3,
            "mfu": last["mfu"], "peak_alloc_mib": last["peak_mem_bytes"] / MIB,
            "peak_reserved_mib": None if reserved is None else reserved / MIB}


def summary(fig: dict[str, Any]) -> str:
    """`figures` in words."""
    mfu = "n/a" if fig["mfu"] is None else f"{fig['mfu']:.1%}"
    reserved = "n/a" if fig["peak_reserved_mib"] is None else f"{fig['peak_reserved_mib']:.0f}"
    return (f"step {fig['ms_per_step']:.1f} ms, MFU {mfu}, peak allocated "
            f"{fig['peak_alloc_mib']:.0f} MiB, reserved {reserved} MiB")


def error_line(e: BaseException) -> str:
    """An exception in one line: its type, its message's first line, where it was raised."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}{where}"


class Rows:
    """The rows file of one part (JSON lines, appended: parts may share one file)."""

    def __init__(self, path: Path | str, part: str):
        self.path, self.part = Path(path), part
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, ok: bool, error: str | None = None, /, **fields: Any) -> dict:
        row = {"part": self.part, "name": name, "ok": ok, "error": error, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        mark = "ok" if ok else f"FAILED {error}"
        shown = "  ".join(f"{k} {_short(v)}" for k, v in fields.items() if v is not None)
        print(f"[{self.part}] {name}: {mark}  {shown}", flush=True)
        return row

    def guarded(self, name: str, check: Callable[[], dict[str, Any]]) -> dict:
        """Run `check` (returning its figures; raising on failure) and write its row; an
        exception's traceback goes to the log, its one line to the row."""
        start = time.perf_counter()
        try:
            found = check()
        except Exception as e:  # noqa: BLE001 -- any failure is this row's result
            traceback.print_exc()
            return self.add(name, False, error_line(e), seconds=time.perf_counter() - start)
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next row's peak starts from its own
        return self.add(name, True, None, **found, seconds=time.perf_counter() - start)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
