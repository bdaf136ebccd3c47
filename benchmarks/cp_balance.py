"""Causal ring attention's load balance: the zig-zag split against the contiguous one.

    python benchmarks/cp_balance.py [--nproc 4] [--seq 4096] [--iters 3] [--heads 8]
                                    [--kv-heads 2] [--head-dim 64] [--batch 1]

Each of the `--nproc` processes (Gloo, CPU) is one cp rank. Each runs ring attention's
forward and backward (ContextAttention, mode "ring") `--iters` times per split, the two
splits alternating so machine noise hits both alike, after one warm-up call of each. Prints
each rank's attention compute seconds (`compute_s`: time inside the blockwise math, not
waiting for blocks), the max / min ratio over ranks for both splits, and the work each rank
was given (chunk pairs of the ring, in units of one zig-zag chunk pair: contiguous rank r
gets 4(r + 1), zig-zag every rank 2N + 1), and the process CPU seconds of each call (forward
and backward, waits included, which cost next to no CPU); the last line is one JSON object.
The compute clock is wall time: with more ranks than cores a rank descheduled mid-block
counts that too, which inflates the light ranks (they compute while all others do) more
than the heavy ones (which compute on while the others wait), so the wall-clock ratio
understates the imbalance; the CPU seconds show it less distorted. A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from teardown import run_then_leave
from shardtrain.comm import build_mesh
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.mesh import MeshShape
from shardtrain.parallel.context import ContextAttention, SequenceSplit
from shardtrain.parallel.context.blocks import chunk_pairs


def work_units(split: SequenceSplit, rank: int) -> int:
    """Chunk pairs rank computes over the ring, in units of one zig-zag chunk pair (a
    contiguous chunk is two zig-zag chunks long: its pair is four units)."""
    area = (split.chunk_len / (split.seq_len // (2 * split.cp))) ** 2
    pairs = sum(len(chunk_pairs(split.chunks(rank), split.chunks((rank - i) % split.cp), True))
                for i in range(split.cp))
    return round(pairs * area)


def worker(args: dict) -> dict:
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), 600.0)
    return run_then_leave(measure, args, info)  # teardown.py: the exit without a hang


def measure(args: dict, info: ProcessInfo) -> dict:
    n, rank = info.world_size, info.rank
    comm = build_mesh(MeshShape(cp=n), rank=rank, timeout_s=600.0).comm("cp")
    gen = torch.Generator().manual_seed(rank)
    b, h, g, d, s = args["batch"], args["heads"], args["kv_heads"], args["head_dim"], args["seq"]
    cores = {name: ContextAttention(comm, SequenceSplit(s, n, zigzag), "ring")
             for name, zigzag in (("zigzag", True), ("contiguous", False))}
    q, k, v = (torch.randn(b, m, s // n, d, generator=gen).requires_grad_()
               for m in (h, g, g))  # [B, H | G, S/N, D]: this rank's tokens

    cpu = dict.fromkeys(cores, 0.0)

    def step(name: str) -> None:
        start = time.process_time()
        cores[name](q, k, v).sum().backward()
        cpu[name] += time.process_time() - start

    for name, core in cores.items():  # warm-up, then the clocks start from zero
        step(name)
        core.reset()
        cpu[name] = 0.0
    for i in range(args["iters"]):
        for name in (list(cores) if i % 2 else list(reversed(cores))):
            step(name)
    result = {name: core.compute_s / args["iters"] for name, core in cores.items()}
    result["work"] = {name: work_units(core.split, rank) for name, core in cores.items()}
    result["cpu"] = {name: t / args["iters"] for name, t in cpu.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4, help="cp ranks (processes)")
    parser.add_argument("--seq", type=int, default=4096, help="full sequence length")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per split")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    SequenceSplit(args.seq, args.nproc, True).check()
    results = launch_local(args.nproc, worker, vars(args))
    ranks = [results[r] for r in range(args.nproc)]
    summary: dict = {"cp": args.nproc, "seq": args.seq, "iters": args.iters,
                     "heads": args.heads, "kv_heads": args.kv_heads,
                     "head_dim": args.head_dim, "batch": args.batch}
    print(f"ring attention forward+backward, cp={args.nproc}, S={args.seq}, B={args.batch}, "
          f"H={args.heads}, G={args.kv_heads}, D={args.head_dim}: compute seconds per call")
    for name in ("zigzag", "contiguous"):
        secs = [r[name] for r in ranks]
        cpu = [r["cpu"][name] for r in ranks]
        work = [r["work"][name] for r in ranks]
        ratio, cpu_ratio = max(secs) / min(secs), max(cpu) / min(cpu)
        print(f"{name:>10}: " + "  ".join(f"rank {i} {t:6.3f}s ({w:2d} units)"
                                           for i, (t, w) in enumerate(zip(secs, work)))
              + f"   max/min {ratio:.2f} (work {max(work) / min(work):.2f})")
        print(f"{'cpu':>10}: " + "  ".join(f"rank {i} {t:6.3f}s           "
                                           for i, t in enumerate(cpu))
              + f"   max/min {cpu_ratio:.2f}")
        summary[name] = {"compute_s": [round(t, 4) for t in secs], "work_units": work,
                         "max_over_min": round(ratio, 3),
                         "work_max_over_min": round(max(work) / min(work), 3),
                         "process_cpu_s": [round(t, 4) for t in cpu],
                         "cpu_max_over_min": round(cpu_ratio, 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
