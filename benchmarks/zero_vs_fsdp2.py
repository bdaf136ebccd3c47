"""Our ZeRO-2 and ZeRO-3 against FSDP2 `fully_shard`, same model, data and optimizer.

    python benchmarks/zero_vs_fsdp2.py [--nproc 4] [--steps 20] [--memory-steps 4]
                                       [--section.field V ...]

Pairs at the matching stage: our ZeRO-2 with FSDP2 `reshard_after_forward=False` (parameters
stay gathered between forward and backward; gradients and optimizer state sharded), our
ZeRO-3 with `reshard_after_forward=True` (parameters re-gathered for backward). FSDP2 wraps
each transformer block and then the root (embedding, final norm, head), as our units do.

Throughput: one launch; each process builds all four trainers and runs one step of each in
turn (interleave.py), so machine noise and drift hit all alike; tokens/s from rank 0.
Peak memory: one launch per trainer, each process building only that trainer, two figures
per rank, both from just before the trainer is built to the end of `--memory-steps` steps:
- allocated: the peak of the bytes malloc has handed out and not taken back (glibc
  mallinfo2: in-use heap chunks in every arena plus mmapped chunks), sampled after every
  tensor op (a TorchDispatchMode) -- the CPU counterpart of CUDA's max_memory_allocated:
  live tensors and buffers, whichever thread allocated them, without the allocator's
  cached free memory. The ratio line uses it.
- resident: the growth of anonymous resident memory (RssAnon), with glibc told not to hand
  freed memory back (MALLOC_TRIM_THRESHOLD_, heap allocations up to 32 MiB) so it only
  grows: it adds the allocator's fragmentation and per-thread arenas, which vary by a few
  MiB from launch to launch (the counterpart of max_memory_reserved).
Gloo's own all_gather_into_tensor and reduce_scatter_tensor allocate a temporary as large as
the full tensor for as long as the collective runs (FSDP2 pays it on every unit); our
point-to-point algorithms do not (`--comm.algorithm ring`: the all-gather writes straight
into the output). Prints both figures per rank and, as the last line, one JSON object with
the ratios ours / FSDP2 (throughput > 1: ours faster; memory < 1: ours smaller, from the
largest rank's allocated peak). A figure, never a test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from interleave import interleaved_tokens_per_s
from teardown import run_then_leave
from shardtrain import config
from shardtrain.config import Config
from shardtrain.data import TokenSampler, load_dataset
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.model.transformer import build_model
from shardtrain.train.optim import build_optimizer
from shardtrain.train.trainer import Trainer

PAIRS = (("zero2", "fsdp2_keep"), ("zero3", "fsdp2_reshard"))  # (ours, FSDP2) per stage
STAGE = {"zero2": 2, "zero3": 3}
RESHARD = {"fsdp2_keep": False, "fsdp2_reshard": True}


def fsdp2_step(model, optimizer, micro_batches, accum: int, clip: float) -> None:
    """One optimizer step in the plain FSDP2 idiom, doing the trainer's work. Gradients are
    reduce-scattered every micro-batch, as our stages 2 and 3 do."""
    optimizer.zero_grad()
    loss_sum = torch.zeros(())
    for inputs, targets in micro_batches:
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        (loss / accum).backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    dist.all_reduce(loss_sum)


def build_runner(name: str, cfg: Config, rank: int, world_size: int) -> Callable[[], object]:
    """One optimizer step of trainer `name`; each has its own data sampler (same batches)."""
    device = torch.device("cpu")
    if name in STAGE:
        trainer = Trainer(with_zero(cfg, STAGE[name]),
                          build_mesh(MeshShape(dp=world_size), rank=rank), device)
        return trainer.train_step
    t = cfg.train
    sampler = TokenSampler(load_dataset(cfg.data, seq_len=t.seq_len).train, seq_len=t.seq_len,
                           global_batch=t.global_batch, micro_batch=t.micro_batch,
                           dp_rank=rank, dp_size=world_size, seed=t.seed)
    model = build_model(cfg.model, seed=t.seed)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=RESHARD[name])
    fully_shard(model, reshard_after_forward=RESHARD[name])
    optimizer = build_optimizer(model, cfg.optim, t.lr)
    accum = t.accumulation_steps(world_size)
    return lambda: fsdp2_step(model, optimizer, sampler.next_step(), accum, cfg.optim.grad_clip)


def with_zero(cfg: Config, stage: int) -> Config:
    """A copy of `cfg` with parallel.zero = stage."""
    out = config.loads(config.to_toml(cfg))
    config.apply(out, "parallel", "zero", stage)
    return out


def throughput_worker(cfg_text: str, steps: int) -> dict[str, float]:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), cfg.comm.timeout_s)
    return run_then_leave(throughput, cfg, info, steps)  # teardown.py: the exit without a hang


def throughput(cfg: Config, info: ProcessInfo, steps: int) -> dict[str, float]:
    runners = {name: build_runner(name, cfg, info.rank, info.world_size)
               for pair in PAIRS for name in pair}
    return interleaved_tokens_per_s(
        runners, steps=steps, tokens_per_step=cfg.train.global_batch * cfg.train.seq_len)


def memory_worker(cfg_text: str, name: str, steps: int) -> dict[str, int]:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), cfg.comm.timeout_s)
    return run_then_leave(memory, cfg, info, name, steps)  # teardown.py: the exit without a hang


def memory(cfg: Config, info: ProcessInfo, name: str, steps: int) -> dict[str, int]:
    before, resident = malloc_in_use_bytes(), rss_anon_bytes()
    with PeakAllocated() as peak:
        run = build_runner(name, cfg, info.rank, info.world_size)
        for _ in range(steps):
            run()
    return {"allocated": peak.peak - before, "resident": rss_anon_bytes() - resident}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def malloc_in_use_bytes() -> int:
    """Bytes malloc has handed out and not taken back, over all arenas (glibc >= 2.33)."""
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise RuntimeError("the allocated-memory figure needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakAllocated(TorchDispatchMode):
    """The largest malloc_in_use_bytes() seen after any tensor op run inside it."""

    def __init__(self):
        super().__init__()
        self.peak = malloc_in_use_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_in_use_bytes())
        return out


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status: the memory figure needs Linux")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each trainer")
    parser.add_argument("--memory-steps", type=int, default=4)
    args, overrides = parser.parse_known_args()
    cfg = config.load("default", ["--train.global_batch", "16", "--train.micro_batch", "4",
                                  "--train.progress", "false", "--train.run_dir",
                                  "runs/bench-zero", *overrides])
    for stage in STAGE.values():
        with_zero(cfg, stage).validate(args.nproc)
    text = config.to_toml(cfg)
    # Inherited by the workers: freed heap memory stays resident (see the module doc).
    os.environ.update(MALLOC_TRIM_THRESHOLD_=str(2**62), MALLOC_MMAP_THRESHOLD_=str(2**25))
    speed = launch_local(args.nproc, throughput_worker, text, args.steps)[0]
    memory = {name: launch_local(args.nproc, memory_worker, text, name, args.memory_steps)
              for pair in PAIRS for name in pair}
    summary = {"nproc": args.nproc, "comm_algorithm": cfg.comm.algorithm}
    for ours, theirs in PAIRS:
        for name in (ours, theirs):
            for kind in ("allocated", "resident"):
                per_rank = ", ".join(f"{memory[name][r][kind] / 2**20:.1f}"
                                     for r in sorted(memory[name]))
                print(f"{name:>14} {speed[name]:8.0f} tokens/s   peak memory ({kind}) per rank "
                      f"(MiB): {per_rank}")
        peak = {n: {kind: max(m[kind] for m in memory[n].values())
                    for kind in ("allocated", "resident")} for n in (ours, theirs)}
        summary[f"{ours}_vs_{theirs}"] = {
            f"{ours}_tokens_per_s": round(speed[ours]), f"{theirs}_tokens_per_s":
            round(speed[theirs]), "throughput_ratio": round(speed[ours] / speed[theirs], 3),
            **{f"{n}_peak_{kind}_mib": round(peak[n][kind] / 2**20, 1)
               for n in (ours, theirs) for kind in ("allocated", "resident")},
            "memory_ratio": round(peak[ours]["allocated"] / peak[theirs]["allocated"], 3),
            "resident_ratio": round(peak[ours]["resident"] / peak[theirs]["resident"], 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
