"""Tokens/s of mixture-of-experts training steps with expert parallelism (ep=2: each rank
holds half the experts, tokens travel by all-to-all) against ep=1 (plain data
parallelism, every rank holding every expert), on 2 processes (Gloo, CPU), same model,
seed and global batch.

    python benchmarks/moe_ep.py [--nproc 2] [--dim 256 --layers 4 --experts 8 --top-k 2]
                                [--seq 256 --global-batch 16 --micro-batch 4]
                                [--steps 6 --warmup 2]

Both layouts train side by side in the same processes, their steps alternating so machine
noise hits both alike; a step's time is the slower rank's (the all-to-alls and the
gradient all-reduce keep the ranks in step), the figure the median over the timed steps.
Prints each layout's tokens/s, the ep=2 / ep=1 ratio, the ep all-to-all bytes one rank
sent per step (ledger) next to the planner's prediction, a markdown row and one JSON line.
A figure, never a test: on a CPU the expert matmuls are small and the all-to-alls' host
syncs and copies are not hidden, so ep trades parameter memory (each rank holds 1/ep of
the experts' weights, gradients and optimizer state) for time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from teardown import run_then_leave
from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.plan.layout import config_layout
from shardtrain.plan.traffic import expert_parallel_ops
from shardtrain.train.trainer import Trainer


def build_config(args: dict, ep: int, run_dir: str) -> config.Config:
    cfg = config.load("tiny", [
        "--model.dim", str(args["dim"]), "--model.n_layers", str(args["layers"]),
        "--model.n_heads", str(args["dim"] // 64), "--model.n_kv_heads", "0",
        "--model.max_seq_len", str(args["seq"]), "--model.n_experts", str(args["experts"]),
        "--model.moe_top_k", str(args["top_k"]), "--train.seq_len", str(args["seq"]),
        "--train.global_batch", str(args["global_batch"]),
        "--train.micro_batch", str(args["micro_batch"]), "--train.steps", "1000",
        "--train.run_dir", f"{run_dir}/ep{ep}", "--parallel.ep", str(ep)])
    cfg.validate(args["nproc"])
    return cfg


def worker(args: dict) -> dict:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 600.0)
    torch.set_num_threads(1)  # two processes on a small machine: one core each
    return run_then_leave(measure, args, info)  # teardown.py: the exit without a hang


def measure(args: dict, info: ProcessInfo) -> dict:
    device = torch.device("cpu")
    trainers = {}
    for ep in (1, 2):
        cfg = build_config(args, ep, args["run_dir"])
        mesh = build_mesh(MeshShape(dp=info.world_size, ep=ep), rank=info.rank)
        trainers[ep] = Trainer(cfg, mesh, device)
    times: dict[int, list[float]] = {ep: [] for ep in trainers}
    ep_bytes: dict[int, list[int]] = {ep: [] for ep in trainers}
    for i in range(args["warmup"] + args["steps"]):
        for ep in (trainers if i % 2 else reversed(list(trainers))):
            trainer = trainers[ep]
            first = len(trainer.mesh.ledger.records)
            record = trainer.train_step()
            if i >= args["warmup"]:
                times[ep].append(record["step_time_s"])
                ep_bytes[ep].append(sum(r.sent_bytes for r in trainer.mesh.ledger.records[first:]
                                        if r.tag == "ep"))
    return {"times": times, "ep_bytes": ep_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = vars(p.parse_args())
    with tempfile.TemporaryDirectory() as run_dir:
        args["run_dir"] = run_dir
        cfg = build_config(args, 2, run_dir)  # checked before any process starts
        results = launch_local(args["nproc"], worker, args)
    ranks = [results[r] for r in range(args["nproc"])]
    tokens = args["global_batch"] * args["seq"]
    rate = {}
    for ep in (1, 2):  # a step lasts as long as its slowest rank
        steps = [max(r["times"][ep][i] for r in ranks) for i in range(args["steps"])]
        rate[ep] = tokens / statistics.median(steps)
    sent = statistics.median(ranks[0]["ep_bytes"][2])
    layout = config_layout(cfg, args["nproc"])
    planned = sum(op.bytes_sent for op in expert_parallel_ops(cfg.model, layout,
                                                              seq_len=args["seq"]))
    ratio = rate[2] / rate[1]
    shape = (f"dim {args['dim']}, {args['layers']} layers, {args['experts']} experts top-"
             f"{args['top_k']}, seq {args['seq']}, global batch {args['global_batch']}, "
             f"micro-batch {args['micro_batch']}, {args['nproc']} processes")
    print(f"MoE training step, {shape}")
    for ep in (1, 2):
        print(f"ep={ep}: {rate[ep]:10.0f} tokens/s")
    print(f"ep=2 / ep=1: {ratio:.2f}x")
    print(f"ep all-to-all bytes sent per step (rank 0, median): {sent:,.0f}; planner "
          f"(uniform routing): {planned:,.0f}")
    print(f"| {shape} | {rate[1]:.0f} | {rate[2]:.0f} | {ratio:.2f}x | {sent:,.0f} | "
          f"{planned:,.0f} |")
    print(json.dumps({k: v for k, v in args.items() if k != "run_dir"}
                     | {"ep1_tokens_per_s": rate[1], "ep2_tokens_per_s": rate[2],
                        "ratio": ratio, "ep_bytes_per_step": sent,
                        "ep_bytes_planned": planned}))


if __name__ == "__main__":
    main()
