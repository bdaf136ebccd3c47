"""Where rank 0's step peak happens, and what it is: the dry run's step (train/start/dryrun.py,
a fake world of N ranks) under a meter that reads malloc's bytes in use after every tensor
op (train/start/meters.py, the CPU counterpart of CUDA's max_memory_allocated) and tags each
reading with what was running: the forward module, or in backward the autograd node
(torch's `_current_autograd_node`). Prints the step's five highest moments, each the
highest of its tag, next to the planner's moments (plan/buffers.py, plan/memory.py).

    python benchmarks/step_peak.py --world 256 --config llama3-8b --parallel.zero 3 \\
        --train.seq_len 64 --train.micro_batch 1 --train.global_batch 256

One warm-up step (the optimizer state appears), then the measured one. CPU only (the dry
run's malloc meter). A figure, never a test.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain import config
from shardtrain.plan.layout import config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.train.start import dryrun
from shardtrain.train.start.meters import malloc_in_use_bytes


class TaggedPeaks(TorchDispatchMode):
    """The most bytes in use seen after an op, per tag (the running module or node)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.peaks: dict[str, int] = {}
        self.stack: list[str] = []
        for name, m in module.named_modules():
            m.register_forward_pre_hook(lambda _m, _a, n=name: self._enter(n or "model"))
            m.register_forward_hook(lambda *_: self._leave())

    def _enter(self, name: str) -> None:
        self.stack.append(name)

    def _leave(self) -> None:  # returns None: the module's output stays
        if self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        tag = (f"backward {node.name()}" if node is not None
               else f"forward {self.stack[-1] if self.stack else '-'}")
        used = malloc_in_use_bytes() or 0
        if used > self.peaks.get(tag, 0):
            self.peaks[tag] = used
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--config", default="tiny")
    args, rest = parser.parse_known_args()
    cfg = config.load(args.config, rest)
    with dryrun.rank0_trainer(cfg, args.world, torch.device("cpu")) as trainer:
        trainer.train_step()  # warm-up: AdamW's state appears
        start = malloc_in_use_bytes() or 0
        with TaggedPeaks(trainer.parallel.module) as meter:
            trainer.train_step()
    held = sum(trainer.memory_ledger()[f"{k}_bytes"] for k in dryrun.STATES)
    print(f"step start: {start / 1e9:.3f} GB malloc'd (model states {held / 1e9:.3f} GB)")
    for tag, used in sorted(meter.peaks.items(), key=lambda kv: -kv[1])[:5]:
        print(f"{used / 1e9:8.3f} GB  (+{(used - start) / 1e9:.3f})  {tag}")
    e = memory_per_gpu(cfg.model, config_layout(cfg, args.world), seq_len=cfg.train.seq_len,
                       bucket_bytes=cfg.comm.bucket_mb * 2**20)
    print(f"planner: total {e.total / 1e9:.3f} GB = model states "
          f"{(e.total - e.activations - e.buffers) / 1e9:.3f} + activations "
          f"{e.activations / 1e9:.3f} + the largest moment {e.buffers / 1e9:.3f}")


if __name__ == "__main__":
    main()
