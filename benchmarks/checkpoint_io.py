"""Save and resume seconds of a sharded checkpoint against the disk's own bandwidth: the
default model on 2 processes, plain data parallelism and ZeRO-3 (and FSDP2 with `--peer`).

    python benchmarks/checkpoint_io.py [--config default] [--nproc 2] [--repeats 3]
        [--peer fsdp2] [any config override, e.g. --model.dim 1024 --model.n_layers 8]

One launch; each process builds both trainers (dp, then ZeRO-3), takes one step, then
`--repeats` times: rank 0 measures the disk (below), then the ranks save a synchronous
checkpoint (timed from a barrier before to the save's return: every rank's write and the
main rank's commit; the first save plans, the later ones reuse its plan, ckpt/saveplan.py:
both printed) and load it back into the same trainer (a fresh reader, timed to the
end of `load_state` on every rank). The disk: what `dd bs=1M count=1024 conv=fsync`
measures, in Python: 1 GiB written in 1 MiB blocks into the checkpoint's directory, then
fsynced, timed to the fsync's return (`disk_mb_s`), the other ranks waiting. Rank 0 prints
the median seconds per layout, the checkpoint's bytes on disk and MB/s (bytes / save
seconds), ours / disk, what each rank wrote, what each rank read while loading
(/proc/self/io rchar) against the checkpoint's bytes over the ranks, and one JSON line.

`--peer fsdp2`: in the same launch, the same model and optimizer wrapped with FSDP2
(`fully_shard` per block and the root, as benchmarks/zero_vs_fsdp2.py), one step, then
`--repeats` saves of its model and optimizer state dicts with
`torch.distributed.checkpoint.save` (timed alike); printed: its seconds, bytes, and
ours / torch (torch's median seconds over our ZeRO-3's: >1 is ours faster; the two store
the same tensors, fp32 weights and Adam's moments, sharded over the same ranks).
Runs on any commit whose Trainer saves with `save()` and reads with
`shardtrain.ckpt.files.Reader`, so the same script measures before and after a change of
format. A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from teardown import run_then_leave
from shardtrain import config
from shardtrain.ckpt.files import Reader
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer

LAYOUTS = {"dp": "0", "zero3": "3"}
DISK_BYTES, DISK_BLOCK = 1 << 30, 1 << 20  # dd bs=1M count=1024


def worker(name: str, run_root: str, repeats: int, peer: str, overrides: list[str]) -> dict:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 600.0)
    # teardown.py: the exit without a hang
    return run_then_leave(measure, name, run_root, repeats, peer, overrides, info)


def measure(name: str, run_root: str, repeats: int, peer: str, overrides: list[str],
            info: ProcessInfo) -> dict:
    out = {}
    for layout, zero in LAYOUTS.items():
        run_dir = Path(run_root) / layout
        cfg = _config(name, run_dir, zero, overrides)
        trainer = Trainer(cfg, build_mesh(MeshShape(dp=info.world_size), rank=info.rank),
                          torch.device("cpu"))
        trainer.train_step()
        save, load, disk = [], [], []
        for _ in range(repeats):
            disk.append(_disk_mb_s(run_dir, info.rank))
            dist.barrier()
            start = time.perf_counter()
            trainer.save()
            save.append(time.perf_counter() - start)
            path = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
            dist.barrier()
            start, chars = time.perf_counter(), _read_chars()
            trainer.parallel.load_state(Reader(path))
            read = _read_chars() - chars
            dist.barrier()
            load.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        out[layout] = {"save_s": statistics.median(save), "resume_s": statistics.median(load),
                       "save_all_s": save, "disk_all_mb_s": disk,
                       "bytes": size, "read_bytes": read,
                       "written": {r: sum(f.stat().st_size for f in path.iterdir()
                                          if f.name.startswith((f"__{r}_", f"shard-{r:05d}")))
                                   for r in range(info.world_size)}}
        del trainer
    if peer == "fsdp2":
        out["fsdp2"] = _fsdp2(_config(name, Path(run_root) / "fsdp2", "0", overrides),
                              Path(run_root) / "fsdp2", repeats, info)
    return out


def _config(name: str, run_dir: Path, zero: str, overrides: list[str]):
    return config.load(name, ["--train.run_dir", str(run_dir), "--train.steps", "1000",
                              "--train.progress", "false", "--parallel.zero", zero,
                              "--checkpoint.keep", "1", "--train.peak_flops", "1e12",
                              *overrides])


def _fsdp2(cfg, root: Path, repeats: int, info: ProcessInfo) -> dict:
    """torch's own: FSDP2 and `torch.distributed.checkpoint.save` (module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from zero_vs_fsdp2 import build_runner

    step = build_runner("fsdp2_reshard", cfg, info.rank, info.world_size)
    step()
    model, optimizer = _model_and_optimizer(step)
    times = []
    for k in range(repeats):
        directory = root / f"save_{k}"
        dist.barrier()
        start = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
        dist.barrier()
        times.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return {"save_s": statistics.median(times), "save_all_s": times, "bytes": size}


def _model_and_optimizer(step):
    """The FSDP2 model and optimizer a `build_runner` step closes over."""
    cells = {name: cell.cell_contents for name, cell in
             zip(step.__code__.co_freevars, step.__closure__)}
    return cells["model"], cells["optimizer"]


def _disk_mb_s(directory: Path, rank: int) -> float:
    """Rank 0: the fsync'd sequential write bandwidth into `directory`, MB/s (10^6 bytes):
    `dd bs=1M count=1024 conv=fsync`; the other ranks wait at the barrier (0.0)."""
    dist.barrier()
    mb_s = 0.0
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        path, block = directory / ".disk_probe", os.urandom(DISK_BLOCK)
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(DISK_BYTES // DISK_BLOCK):
                f.write(block)
            os.fsync(f.fileno())
        mb_s = DISK_BYTES / (time.perf_counter() - start) / 1e6
        path.unlink()
    dist.barrier()
    return mb_s


def _read_chars() -> int:
    """Bytes this process has read through read() calls (/proc/self/io rchar: page-cache
    hits included, unlike read_bytes)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="default")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peer", choices=["none", "fsdp2"], default="none")
    args, overrides = p.parse_known_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("CKPT_BENCH_DIR")) as root:
        results = launch_local(args.nproc, worker, args.config, root, args.repeats,
                               args.peer, overrides)
    r = results[0]
    disk = statistics.median(x for row in r.values() for x in row.get("disk_all_mb_s", []))
    r["disk_mb_s"] = disk
    for layout in LAYOUTS:
        row = r[layout]
        reads = [results[k][layout]["read_bytes"] for k in sorted(results)]
        share = row["bytes"] / args.nproc
        written = list(row["written"].values())
        row["mb_s"] = row["bytes"] / row["save_s"] / 1e6
        print(f"{args.config} {' '.join(overrides)}, {layout}, {args.nproc} processes: save "
              f"{row['save_s']:.3f} s (the first, planning: {row['save_all_s'][0]:.2f} s; "
              f"{row['mb_s']:.0f} MB/s, ours / disk "
              f"{row['mb_s'] / disk:.2f}x of the disk's {disk:.0f} MB/s fsync'd), resume "
              f"{row['resume_s']:.2f} s, {row['bytes'] / 2**20:.1f} MiB on disk; written per "
              f"rank {[round(w / 2**20, 1) for w in written]} MiB; read per rank on resume / "
              f"(checkpoint / ranks): {[round(x / share, 2) for x in reads]}")
        row["read_per_rank"] = reads
    if "fsdp2" in r:
        peer = r["fsdp2"]
        r["ours_over_torch"] = peer["save_s"] / r["zero3"]["save_s"]
        print(f"fsdp2 + torch.distributed.checkpoint.save: {peer['save_s']:.3f} s, "
              f"{peer['bytes'] / 2**20:.1f} MiB on disk; ours (ZeRO-3) / torch "
              f"{r['ours_over_torch']:.2f}x")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
