"""Our data parallelism against torch DistributedDataParallel, same model, data and steps.

    python benchmarks/dp_vs_torch_ddp.py [--nproc 4] [--steps 10] [--rounds 3] [--section.field V ...]

Each process runs both trainers on the same model (default preset), the same micro-batches
and the same optimizer, alternating in rounds so that machine noise hits both alike.
Prints tokens/s of each (median over rounds) and, as the last line, one JSON object with
their ratio (ours / torch; > 1 means ours is faster). A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from shardtrain import config
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape, ParallelMesh
from shardtrain.model.transformer import build_model
from shardtrain.train.optim import build_optimizer
from shardtrain.train.trainer import Trainer


def torch_ddp_step(ddp, optimizer, micro_batches, accum: int, clip: float) -> None:
    """One optimizer step in the plain torch DDP idiom, doing the trainer's work."""
    optimizer.zero_grad(set_to_none=False)
    loss_sum = torch.zeros(())
    for i, (inputs, targets) in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1
        with nullcontext() if sync else ddp.no_sync():
            loss = F.cross_entropy(ddp(inputs).float().flatten(0, 1), targets.flatten())
            (loss / accum).backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
    optimizer.step()
    torch.distributed.all_reduce(loss_sum)


def worker(cfg_text: str, steps: int, rounds: int) -> dict:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    device = torch.device("cpu")
    init_distributed(info, device, cfg.comm.timeout_s)
    mesh = ParallelMesh(MeshShape(dp=info.world_size), rank=info.rank)
    ours = Trainer(cfg, mesh, device)
    model = build_model(cfg.model, seed=cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.comm.bucket_mb)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr)
    tokens = cfg.train.global_batch * cfg.train.seq_len * steps
    times = {"ours": [], "torch_ddp": []}
    for r in range(rounds + 1):  # round 0 warms up both
        start = time.perf_counter()
        for _ in range(steps):
            ours.train_step()
        t_ours = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            torch_ddp_step(ddp, optimizer, ours.sampler.next_step(), ours.accum,
                           cfg.optim.grad_clip)
        t_ddp = time.perf_counter() - start
        if r:
            times["ours"].append(tokens / t_ours)
            times["torch_ddp"].append(tokens / t_ddp)
    torch.distributed.destroy_process_group()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--train.global_batch", "16", "--train.micro_batch", "4",
                                  "--train.progress", "false", "--train.run_dir",
                                  "runs/bench-dp", *overrides])
    cfg.validate(args.nproc)
    results = launch_local(args.nproc, worker, config.to_toml(cfg), args.steps, args.rounds)[0]
    ratio = results["ours"] / results["torch_ddp"]
    print(f"ours      {results['ours']:10.0f} tokens/s")
    print(f"torch DDP {results['torch_ddp']:10.0f} tokens/s")
    print(json.dumps({"nproc": args.nproc, "ours_tokens_per_s": round(results["ours"]),
                      "torch_ddp_tokens_per_s": round(results["torch_ddp"]),
                      "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
