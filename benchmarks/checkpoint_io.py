"""Save and resume seconds of a sharded checkpoint: the default model on 2 processes, plain
data parallelism and ZeRO-3.

    python benchmarks/checkpoint_io.py [--config default] [--nproc 2] [--repeats 3]

One launch; each process builds both trainers (dp, then ZeRO-3), takes one step, then
`--repeats` times: saves a synchronous checkpoint (timed from a barrier before to the
save's return: every rank's write and the main rank's commit) and loads it back into the
same trainer (a fresh reader, timed to the end of `load_state` on every rank). Rank 0
prints the median seconds per layout, the checkpoint's bytes on disk, what each rank
wrote, what each rank read while loading (/proc/self/io rchar) against the checkpoint's
bytes over the ranks, and one JSON line.
Runs on any commit whose Trainer saves with `save()` and reads with
`shardtrain.ckpt.files.Reader`, so the same script measures before and after a change of
format. A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
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


def worker(name: str, run_root: str, repeats: int) -> dict:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 300.0)
    # teardown.py: the exit without a hang
    return run_then_leave(measure, name, run_root, repeats, info)


def measure(name: str, run_root: str, repeats: int, info: ProcessInfo) -> dict:
    out = {}
    for layout, zero in LAYOUTS.items():
        run_dir = Path(run_root) / layout
        cfg = config.load(name, ["--train.run_dir", str(run_dir), "--train.steps", "1000",
                                 "--train.progress", "false", "--parallel.zero", zero,
                                 "--checkpoint.keep", "1", "--train.peak_flops", "1e12"])
        trainer = Trainer(cfg, build_mesh(MeshShape(dp=info.world_size), rank=info.rank),
                          torch.device("cpu"))
        trainer.train_step()
        save, load = [], []
        for _ in range(repeats):
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
                       "bytes": size, "read_bytes": read,
                       "written": {r: sum(f.stat().st_size for f in path.iterdir()
                                          if f.name.startswith((f"__{r}_", f"shard-{r:05d}")))
                                   for r in range(info.world_size)}}
    return out


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
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = launch_local(args.nproc, worker, args.config, root, args.repeats)
    r = results[0]
    for layout, row in r.items():
        reads = [results[k][layout]["read_bytes"] for k in sorted(results)]
        share = row["bytes"] / args.nproc
        written = list(row["written"].values())
        print(f"{args.config}, {layout}, {args.nproc} processes: save {row['save_s']:.2f} s, "
              f"resume {row['resume_s']:.2f} s, {row['bytes'] / 2**20:.1f} MiB on disk; "
              f"written per rank {[round(w / 2**20, 1) for w in written]} MiB; read per rank "
              f"on resume / (checkpoint / ranks): {[round(x / share, 2) for x in reads]}")
        row["read_per_rank"] = reads
    print(json.dumps(r))


if __name__ == "__main__":
    main()
