"""Our data parallelism against torch DistributedDataParallel, same model, data and steps.

    python benchmarks/dp_vs_torch_ddp.py [--nproc 4] [--steps 40] [--section.field V ...]

Each process runs both trainers on the same model (default preset), the same micro-batches
and the same optimizer, one step of each in turn (alternating which goes first), so that
machine noise and drift hit both alike. Prints tokens/s of each (rank 0's timing) and, as the last line, one JSON object with
their ratio (ours / torch; > 1 means ours is faster). A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from interleave import interleaved_tokens_per_s
from teardown import run_then_leave
from shardtrain import config
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
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


def worker(cfg_text: str, steps: int) -> dict:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), cfg.comm.timeout_s)
    return run_then_leave(measure, cfg, info, steps)  # teardown.py: the exit without a hang


def measure(cfg: config.Config, info: ProcessInfo, steps: int) -> dict:
    device = torch.device("cpu")
    mesh = build_mesh(MeshShape(dp=info.world_size), rank=info.rank)
    ours = Trainer(cfg, mesh, device)
    model = build_model(cfg.model, seed=cfg.train.seed)
    # The model's buffers (RoPE tables) are constant: broadcasting them every forward, DDP's
    # default, would be work our trainer does not do.
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.comm.bucket_mb, forward_sync_buffers=False)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr)
    runners = {
        "ours": lambda: ours.train_step(),
        "torch_ddp": lambda: torch_ddp_step(ddp, optimizer, ours.sampler.next_step(), ours.accum,
                                            cfg.optim.grad_clip),
    }
    return interleaved_tokens_per_s(
        runners, steps=steps, tokens_per_step=cfg.train.global_batch * cfg.train.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each trainer")
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--train.global_batch", "16", "--train.micro_batch", "4",
                                  "--train.progress", "false", "--train.run_dir",
                                  "runs/bench-dp", *overrides])
    cfg.validate(args.nproc)
    results = launch_local(args.nproc, worker, config.to_toml(cfg), args.steps)[0]
    ratio = results["ours"] / results["torch_ddp"]
    print(f"ours      {results['ours']:10.0f} tokens/s")
    print(f"torch DDP {results['torch_ddp']:10.0f} tokens/s")
    print(json.dumps({"nproc": args.nproc, "ours_tokens_per_s": round(results["ours"]),
                      "torch_ddp_tokens_per_s": round(results["torch_ddp"]),
                      "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
