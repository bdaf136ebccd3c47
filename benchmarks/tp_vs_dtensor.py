"""Our tensor parallelism against DTensor's `parallelize_module`, same model, data and steps.

    python benchmarks/tp_vs_dtensor.py [--nproc 4] [--steps 20] [--section.field V ...]

Every process joins one tensor-parallel group of `nproc` ranks (tp = nproc, no sp). Ours is
the trainer's step; DTensor's splits the same plain model with ColwiseParallel /
RowwiseParallel (attention and MLP, Megatron's pairing), a vocab-parallel embedding
(RowwiseParallel) and head (ColwiseParallel with `loss_parallel`), and runs the same
micro-batches with the same optimizer. Gradient clipping is off for both (DTensor's
would need every parameter as a DTensor). One step of each in turn, alternating which goes
first, so machine noise hits both alike. Prints tokens/s of each (rank 0's timing) and, as
the last line, one JSON object with their ratio (ours / DTensor; > 1 means ours is faster).
A figure, never a test.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

from interleave import interleaved_tokens_per_s
from teardown import run_then_leave
from shardtrain import config
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.model.transformer import build_model
from shardtrain.train.optim import build_optimizer
from shardtrain.train.trainer import Trainer


def dtensor_model(cfg: config.Config, world_size: int) -> torch.nn.Module:
    model = build_model(cfg.model, seed=cfg.train.seed)
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.model.n_layers):
        plan |= {f"layers.{i}.attn.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan |= {f"layers.{i}.mlp.{name}": ColwiseParallel() for name in ("w1", "w3")}
        plan |= {f"layers.{i}.attn.wo": RowwiseParallel(), f"layers.{i}.mlp.w2": RowwiseParallel()}
    return parallelize_module(model, DeviceMesh("cpu", list(range(world_size))), plan)


def dtensor_step(model, optimizer, micro_batches, accum: int) -> None:
    """One optimizer step in the DTensor idiom, doing the trainer's work."""
    optimizer.zero_grad(set_to_none=False)
    loss_sum = torch.zeros(())
    for inputs, targets in micro_batches:
        with loss_parallel():
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            (loss / accum).backward()
        loss_sum += loss.detach().full_tensor()
    optimizer.step()


def worker(cfg_text: str, steps: int) -> dict:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), cfg.comm.timeout_s)
    return run_then_leave(measure, cfg, info, steps)  # teardown.py: the exit without a hang


def measure(cfg: config.Config, info: ProcessInfo, steps: int) -> dict:
    device = torch.device("cpu")
    mesh = build_mesh(MeshShape(tp=info.world_size), rank=info.rank)
    ours = Trainer(cfg, mesh, device)
    model = dtensor_model(cfg, info.world_size)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr)
    runners = {
        "ours": lambda: ours.train_step(),
        "dtensor": lambda: dtensor_step(model, optimizer, ours.sampler.next_step(), ours.accum),
    }
    return interleaved_tokens_per_s(
        runners, steps=steps, tokens_per_step=cfg.train.global_batch * cfg.train.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--train.global_batch", "8", "--train.micro_batch", "4",
                                  "--optim.grad_clip", "0", "--train.progress", "false",
                                  "--train.run_dir", "runs/bench-tp", "--parallel.tp",
                                  str(args.nproc), *overrides])
    cfg.validate(args.nproc)
    results = launch_local(args.nproc, worker, config.to_toml(cfg), args.steps)[0]
    ratio = results["ours"] / results["dtensor"]
    print(f"ours     {results['ours']:10.0f} tokens/s")
    print(f"DTensor  {results['dtensor']:10.0f} tokens/s")
    print(json.dumps({"nproc": args.nproc, "tp": args.nproc,
                      "ours_tokens_per_s": round(results["ours"]),
                      "dtensor_tokens_per_s": round(results["dtensor"]), "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
