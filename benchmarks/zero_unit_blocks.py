"""ZeRO-3's unit size (`parallel.zero_unit_blocks`): step time and step peak memory of the
default model with units of 1 block, 2 blocks and all blocks (seed 003: units too fine pay
a collective's latency each, units too coarse hold more parameters gathered at once).

    python benchmarks/zero_unit_blocks.py [--nproc 2] [--steps 10] [--section.field V ...]

One launch; each process builds the three ZeRO-3 trainers and runs one step of each in
turn, alternating the order, after one warm-up step each, so machine noise and drift hit
all alike: rank 0's mean wall time per step. Then one more step of each under the memory
meter (train/start/meters.py `StepGrowth`: on CPU the bytes malloc has handed out, sampled
after every tensor op; the CPU counterpart of CUDA's max_memory_allocated): the step peak
is the trainer's model states (its memory ledger) plus the step's growth above them, the
dry run's measure. Also the all-gathers per step from the ledger. Last line: one JSON
object. A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from teardown import run_then_leave
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.train.start.meters import StepGrowth
from shardtrain.train.trainer import Trainer

STATES = ("params", "grads", "master", "optimizer")


def worker(cfg_text: str, sizes: list[int], steps: int) -> dict[int, dict[str, float]]:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), config.loads(cfg_text).comm.timeout_s)
    return run_then_leave(measure, cfg_text, info, sizes, steps)  # teardown.py


def measure(cfg_text: str, info: ProcessInfo, sizes: list[int],
            steps: int) -> dict[int, dict[str, float]]:
    trainers = {}
    for k in sizes:
        cfg = config.loads(cfg_text)
        config.apply(cfg, "parallel", "zero_unit_blocks", str(k))
        mesh = build_mesh(MeshShape(dp=info.world_size), rank=info.rank)
        trainers[k] = Trainer(cfg, mesh, torch.device("cpu"))
    for t in trainers.values():  # warm-up
        t.train_step()
    wall = {k: 0.0 for k in trainers}
    for i in range(steps):
        for k in (sizes if i % 2 else list(reversed(sizes))):
            start = time.perf_counter()
            trainers[k].train_step()
            wall[k] += time.perf_counter() - start
    out = {}
    for k, t in trainers.items():
        held = sum(t.memory_ledger()[f"{s}_bytes"] for s in STATES)
        before = len(t.mesh.ledger.records)
        with StepGrowth(torch.device("cpu")) as growth:
            t.train_step()
        gathers = sum(r.op == "all_gather" and r.tag == "param"
                      for r in t.mesh.ledger.records[before:])
        out[k] = {"wall_s": wall[k] / steps, "units": len(t.parallel.update.units),
                  "gathers": gathers,
                  "peak_mib": (held + (growth.bytes or 0)) / 2**20}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each trainer")
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--parallel.zero", "3", "--train.progress", "false",
                                  "--train.run_dir", "runs/bench-unit-blocks", *overrides])
    sizes = sorted({1, 2, cfg.model.n_layers})
    for k in sizes:
        check = config.loads(config.to_toml(cfg))
        config.apply(check, "parallel", "zero_unit_blocks", str(k))
        check.validate(args.nproc)
    result = launch_local(args.nproc, worker, config.to_toml(cfg), sizes, args.steps)[0]
    for k, r in result.items():
        print(f"zero_unit_blocks={k}: {r['units']} units, {r['gathers']} all-gathers per step, "
              f"{r['wall_s']:.3f} s per step, step peak {r['peak_mib']:.1f} MiB (rank 0)")
    print(json.dumps({"nproc": args.nproc, "steps": args.steps, "layers": cfg.model.n_layers,
                      **{f"k{k}_{n}": round(v, 4) for k, r in result.items()
                         for n, v in r.items()}}))


if __name__ == "__main__":
    main()
