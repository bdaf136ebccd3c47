"""The cost of ZeRO-Infinity's parameter offload: ZeRO-3 step time with the parameter
shards (and the optimizer state) offloaded, `parallel.offload` cpu and nvme, against
ZeRO-3 on the device, same run.

    python benchmarks/zero_offload_cost.py [--nproc 2] [--steps 20] [--section.field V ...]

One launch; each process builds the three ZeRO-3 trainers of the default model (offload
none, cpu, and nvme in a temporary directory) and runs one step of each in turn,
alternating the order, after one warm-up step each, so machine noise and drift hit all
alike. Per trainer, rank 0's mean wall time per step and the CPU seconds its process spent
per step (time.process_time: every thread of the process; the figure a shared machine
disturbs least, as it does not count the time spent waiting for a core). Then, on the
offloaded trainers, the staging itself: the CPU seconds of one step's fetches (every
unit's shard from its offloaded master, twice: its forward and backward gathers), on one
thread (torch's idle worker threads spin, and process_time would count them), median of
20. Last line: one JSON object, with the ratios offloaded / on the device. A figure, never
a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from teardown import run_then_leave
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.train.trainer import Trainer

OFFLOADS = ("none", "cpu", "nvme")


def worker(cfg_text: str, steps: int, offload_dir: str) -> dict[str, dict[str, float]]:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), config.loads(cfg_text).comm.timeout_s)
    return run_then_leave(measure, cfg_text, info, steps, offload_dir)  # teardown.py: the exit without a hang


def measure(cfg_text: str, info: ProcessInfo, steps: int,
            offload_dir: str) -> dict[str, dict[str, float]]:
    runners = {}
    for offload in OFFLOADS:
        cfg = config.loads(cfg_text)
        config.apply(cfg, "parallel", "offload", offload)
        config.apply(cfg, "parallel", "offload_dir", offload_dir)
        mesh = build_mesh(MeshShape(dp=info.world_size), rank=info.rank)
        runners[offload] = Trainer(cfg, mesh, torch.device("cpu")).train_step
    for run in runners.values():  # warm-up
        run()
    wall = {name: 0.0 for name in runners}
    cpu = {name: 0.0 for name in runners}
    for i in range(steps):
        for name in (list(runners) if i % 2 else list(reversed(runners))):
            start, start_cpu = time.perf_counter(), time.process_time()
            runners[name]()
            wall[name] += time.perf_counter() - start
            cpu[name] += time.process_time() - start_cpu
    out = {name: {"wall_s": wall[name] / steps, "cpu_s": cpu[name] / steps}
           for name in runners}
    for name in ("cpu", "nvme"):
        out[name]["staging_cpu_s"] = staging_cpu_s(runners[name].__self__)
    return out


def staging_cpu_s(trainer: Trainer, repeats: int = 20) -> float:
    """The CPU seconds of one step's staging (module docstring), median of `repeats`."""
    update = trainer.parallel.update
    outs = [torch.empty(u.shard_numel, dtype=u.flat.dtype) for u in update.units]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(2):  # the forward and the backward gather
            for unit, out in zip(update.units, outs):
                update.gatherer.source(unit, out)
        times.append(time.process_time() - start)
    torch.set_num_threads(threads)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each trainer")
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--parallel.zero", "3", "--train.progress", "false",
                                  "--train.run_dir", "runs/bench-offload", *overrides])
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as offload_dir:
        for offload in OFFLOADS:
            check = config.loads(config.to_toml(cfg))
            config.apply(check, "parallel", "offload", offload)
            config.apply(check, "parallel", "offload_dir", offload_dir)
            check.validate(args.nproc)
        result = launch_local(args.nproc, worker, config.to_toml(cfg), args.steps,
                              offload_dir)[0]
    for name, r in result.items():
        staging = f", staging {1e3 * r['staging_cpu_s']:.2f} CPU ms" if name != "none" else ""
        print(f"{name:>5}: {r['wall_s']:.3f} s wall, {r['cpu_s']:.3f} CPU s per step (rank 0)"
              + staging)
    summary = {"nproc": args.nproc, "steps": args.steps,
               **{f"{n}_{k}": round(r[k], 5) for n, r in result.items() for k in r},
               **{f"{n}_vs_none_{k}": round(result[n][k] / result["none"][k], 3)
                  for n in ("cpu", "nvme") for k in ("wall_s", "cpu_s")}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
