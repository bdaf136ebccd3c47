"""The optimizer state and step on the host: ZeRO-Offload (`parallel.offload = cpu`) and
ZeRO-Infinity's NVMe tier (`parallel.offload = nvme`), for flat fp32 master shards.

ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and the Adam moments in host
memory and runs the optimizer step on the CPU: the device holds only the (compute-dtype)
parameter shard and its gradient; per step the gradient shard goes down to the host and
the updated parameters come back up. On a CUDA device the host tensors are pinned and the
copies run on a side stream of their own (after the compute stream's gradients are ready;
the compute stream waits for the uploads before the next forward), so the gradient of
shard k+1 travels while shard k is updated and the upload of shard k while k+1 is.

ZeRO-Infinity (Rajbhandari et al. 2021) moves that state one tier further, to NVMe: each
unit shard's master weights and moments live in one file under `parallel.offload_dir`, and
the step streams the file through a window of `stream_numel` elements at a time, memory-
mapping only that window of each state, so the process never holds the whole optimizer
state (12 bytes per parameter for AdamW) in memory. A file is [master | exp_avg |
exp_avg_sq], each [shard] fp32, so `master(k)` can map the master weights alone.

Under ZeRO-3 the parameters go too, as ZeRO-Infinity offloads them: the fp32 master shard
IS the parameter shard, so no shard stays on the device between uses. The gatherer
(gather.py `UnitGatherer.fetch_from`) stages a unit's shard from its master (`fetch`) just
before the unit's all-gather, as far ahead as the gathers are prefetched
(`parallel.zero_prefetch`), and frees it once the gather is done; the step updates the
master where it lives (`step(..., params=None)`) and writes no device shard. ZeRO-1 and 2
keep their full flat parameters on the device by definition: the step writes this rank's
slice of them, all-gathered after it (model.py).

Gradients (ZeRO-2 and 3, `grads`): each shard has a host buffer (`grad_buffer`, pinned on
CUDA) that the reducer reduces it into (reducer.py `offload_grads`); clipping and the step
read it there, so no gradient shard stays on the device (ZeRO-Offload's gradients; the
nvme tier keeps them in host memory too). ZeRO-1's shard is a view of its full gradients.

HostOptimizer is a shard_optim.ShardOptimizer whose update is `update_shard` (torch.optim's
arithmetic, op for op), so an offloaded run reproduces an on-device one.
"""

from __future__ import annotations

import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardtrain.config import Config, OptimConfig
from shardtrain.parallel.zero.offload_files import (check_offload_dir, check_offload_space,
                                                     make_state_folder, offload_bytes,
                                                     state_names)
from shardtrain.parallel.zero.optim import MemoryOptimizer, Runs, ShardOptimizer, update_shard

__all__ = ["HostOptimizer", "build_shard_optimizer", "check_offload_dir", "check_offload_space",
           "offload_bytes", "state_names"]

STREAM_NUMEL = 1 << 20  # elements per streamed window: 4 MiB of each fp32 state


def build_shard_optimizer(masters: list[torch.Tensor], decay: list[Runs], cfg: Config, *,
                          aliased: bool, rank: int, small: list[Runs] | None = None
                          ) -> ShardOptimizer:
    """The shard optimizer `parallel.offload` and `optim.name` ask for: beside the model
    (MemoryOptimizer; `aliased`: the masters are the fp32 parameter shards themselves; with
    8-bit moments for adamw8bit, `small` the runs that keep fp32 ones) or on the host."""
    p = cfg.parallel
    if cfg.optim.name == "adamw8bit":  # config validation refuses it with offload
        from shardtrain.parallel.zero.optim8bit import Adam8bitShardOptimizer

        return Adam8bitShardOptimizer(masters, decay, small or [[] for _ in masters], cfg.optim,
                                      aliased=aliased)
    if p.offload == "none":
        return MemoryOptimizer(masters, decay, cfg.optim, aliased=aliased, seed=cfg.train.seed)
    return HostOptimizer(masters, decay, cfg.optim, offload=p.offload, directory=p.offload_dir,
                         rank=rank, grads=p.zero >= 2)


@dataclass
class _Shard:
    numel: int
    decay: Runs  # where weight decay applies
    host: torch.Tensor | None = None  # cpu: [states, numel] fp32
    path: Path | None = None  # nvme: the state file, [states, numel] fp32
    grad: torch.Tensor | None = None  # [numel] fp32 host: the offloaded gradient shard
    # (`grads`), or on a CUDA device the pinned staging the step copies it down into


class HostOptimizer:
    """A ShardOptimizer (AdamW or SGD) whose fp32 master shards and moments live on the host
    (`cpu`) or in files (`nvme`).

    `masters`: each shard's initial values (copied; any device); `decay`: each shard's
    weight-decay runs (FlatUnit.decay_runs). `step(grads, params, lr)` writes the new values
    into `params`, the device shards (any float dtype), or, with `params` None (ZeRO-3's
    offloaded parameters), nowhere else: `fetch` reads them when a unit is next gathered.
    `grads`: hold every shard's gradient in a host buffer (`grad_buffer`; module docstring)."""

    def __init__(self, masters: list[torch.Tensor], decay: list[Runs],
                 optim: OptimConfig, *, offload: str, directory: str = "", rank: int = 0,
                 stream_numel: int = STREAM_NUMEL, grads: bool = False):
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"parallel.offload={offload!r}: HostOptimizer serves cpu or nvme")
        self.optim, self.offload, self.stream_numel = optim, offload, stream_numel
        self.holds_grads = grads
        self.states = state_names(optim)
        self.steps = 0  # optimizer steps taken (Adam's bias correction)
        self.directory: Path | None = None
        cuda = any(m.is_cuda for m in masters)
        # The host <-> device copies' own stream (cpu offload on CUDA; None elsewhere).
        self.stream = torch.cuda.Stream(masters[0].device) if cuda and offload == "cpu" \
            else None
        if offload == "nvme":
            check_offload_dir(directory, offload_bytes(sum(m.numel() for m in masters), optim))
            self.directory = make_state_folder(directory, rank)
            # The files go when this optimizer does (or at interpreter exit).
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.shards: list[_Shard] = []
        for k, (master, runs) in enumerate(zip(masters, decay, strict=True)):
            shard = _Shard(numel=master.numel(), decay=runs)
            init = torch.zeros(len(self.states), shard.numel, dtype=torch.float32, device="cpu")
            init[0] = master.detach().reshape(-1).float().cpu()  # [states, numel]
            if grads or (cuda and offload == "cpu"):  # [numel] fp32, on the host
                shard.grad = torch.zeros(shard.numel, dtype=torch.float32, device="cpu",
                                         pin_memory=cuda)
            if offload == "cpu":
                shard.host = init.pin_memory() if cuda else init
            else:
                shard.path = self.directory / f"unit{k:04d}.fp32"
                self._write_file(shard.path, init)
            self.shards.append(shard)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor] | None,
             lr: float) -> None:
        self.steps += 1
        if self.offload == "cpu":
            self._step_cpu(grads, params, lr)
            return
        for k, (shard, grad) in enumerate(zip(self.shards, grads, strict=True)):
            g = grad.reshape(-1)
            p = None if params is None else params[k].view(-1)
            for start, end, window in self._windows(shard):  # window: states x [end - start]
                update_shard(window[0], window[1:], g[start:end].float().cpu(),
                             _clip(shard.decay, start, end), lr, self.steps, self.optim)
                if p is not None:
                    p[start:end].copy_(window[0])
                del window  # unmaps it: one window of each state is mapped at a time

    def _step_cpu(self, grads: list[torch.Tensor], params: list[torch.Tensor] | None,
                  lr: float) -> None:
        if self.stream is None:  # host tensors only: plain copies
            for k, (shard, grad) in enumerate(zip(self.shards, grads, strict=True)):
                update_shard(shard.host[0], list(shard.host[1:]), grad.reshape(-1).float(),
                             shard.decay, lr, self.steps, self.optim)
                if params is not None:
                    params[k].view(-1).copy_(shard.host[0])
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)  # the gradient shards are final on the compute stream
        events = []
        with torch.cuda.stream(self.stream):
            for shard, grad in zip(self.shards, grads, strict=True):  # every gradient down
                if grad is not shard.grad:  # offloaded gradients are there already
                    shard.grad.copy_(grad.reshape(-1), non_blocking=True)
                    grad.record_stream(self.stream)  # not reused before the copy is done
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
            for k, (shard, event) in enumerate(zip(self.shards, events, strict=True)):
                # This shard's gradient is on the host; and, the copy stream having waited
                # for the compute stream, so is every fetch (upload) of this master that the
                # forward and backward queued: the update below cannot race one.
                event.synchronize()
                update_shard(shard.host[0], list(shard.host[1:]), shard.grad, shard.decay, lr,
                             self.steps, self.optim)
                if params is not None:
                    # Pinned source on the copy stream: the upload overlaps the next update,
                    # and the next step's update of this buffer waits behind it (stream order).
                    params[k].view(-1).copy_(shard.host[0], non_blocking=True)
        compute.wait_stream(self.stream)  # the next forward reads the new parameters

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """{"steps", "shards": [{state name: fp32 [numel]}]}: whole tensors (checkpoints)."""
        return {"steps": self.steps,
                "shards": [{name: t.clone() for name, t in self.shard_state(k).items()}
                           for k in range(len(self.shards))]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for shard, tensors in zip(self.shards, state["shards"], strict=True):
            whole = torch.stack([tensors[name].reshape(-1).float() for name in self.states])
            if shard.host is not None:
                shard.host.copy_(whole)
            else:
                self._write_file(shard.path, whole)

    def shard_state(self, k: int) -> dict[str, torch.Tensor]:
        """Shard k's state by name, [numel] fp32 each: nvme's mapped, never read whole (a
        save streams it into its staging buffers, ckpt/stream.py)."""
        s, n = self.shards[k], len(self.states)
        return dict(zip(self.states, s.host if s.host is not None else
                        [self._map(s, i, 0, s.numel) for i in range(n)]))

    @torch.no_grad()
    def load_shard_state(self, k: int, state: dict[str, torch.Tensor]) -> None:
        shard = self.shards[k]
        whole = torch.stack([state[name].reshape(-1).float().cpu() for name in self.states])
        if shard.host is not None:
            shard.host.copy_(whole)
        else:
            self._write_file(shard.path, whole)

    def master(self, k: int) -> torch.Tensor:
        """Shard k's fp32 master weights [shard], a view of the state: writes go to it
        (nvme: the mapped file region; mapped while the tensor lives)."""
        shard = self.shards[k]
        if shard.host is not None:
            return shard.host[0]
        return self._map(shard, 0, 0, shard.numel)

    @torch.no_grad()
    def fetch(self, k: int, out: torch.Tensor) -> None:
        """ZeRO-Infinity's parameter path: out [shard] (the unit's staging shard on the
        device, the parameter dtype) <- shard k's master weights. cpu: from the host tensor
        (pinned on CUDA: an asynchronous upload on the current stream). nvme: from the
        file, one mapped window at a time; on CUDA through a pinned bounce buffer, NVMe ->
        pinned host -> device, whose upload is asynchronous too (the caching host allocator
        reuses the buffer only once the copy reading it is done)."""
        shard = self.shards[k]
        if shard.host is not None:
            out.copy_(shard.host[0], non_blocking=out.is_cuda)
            return
        stage = torch.empty(shard.numel, dtype=torch.float32, device="cpu",  # the host side
                            pin_memory=True) if out.is_cuda else out  # [shard]
        for start, end, window in self._windows(shard, states=1):
            stage[start:end].copy_(window[0])
            del window  # unmapped
        if stage is not out:
            out.copy_(stage, non_blocking=True)

    def grad_buffer(self, k: int) -> torch.Tensor:
        """Shard k's gradient home on the host [numel] fp32 (`grads`; module docstring)."""
        if not self.holds_grads:
            raise ValueError("built with grads=False: the gradient shards stay on the device")
        return self.shards[k].grad

    def memory(self) -> dict[str, int]:
        """Nothing on the device; the whole state in host memory (cpu) or files (nvme).
        Under ZeRO-3 that includes the parameter shards: the master is the parameter. With
        `grads`, the host gradient buffers too."""
        held = sum(4 * s.numel * (len(self.states) + self.holds_grads) for s in self.shards)
        return {"master_bytes": 0, "optimizer_bytes": 0, "offloaded_bytes": held}

    def close(self) -> None:
        """Delete the nvme state files now (otherwise when this object is collected)."""
        if self.directory is not None:
            self._cleanup()

    # ------------------------------------------------------------------ files

    def _windows(self, shard: _Shard, states: int | None = None):
        """(start, end, [each state's mapped [end - start] fp32 window]): every state, or
        the first `states` (1: the master weights alone)."""
        for start in range(0, shard.numel, self.stream_numel):
            end = min(shard.numel, start + self.stream_numel)
            yield start, end, [self._map(shard, i, start, end)
                               for i in range(states or len(self.states))]

    @staticmethod
    def _map(shard: _Shard, state: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of one state, memory-mapped from the shard's file."""
        return torch.from_numpy(np.memmap(shard.path, dtype=np.float32, mode="r+",
                                          offset=4 * (state * shard.numel + start),
                                          shape=(end - start,)))

    def _write_file(self, path: Path, whole: torch.Tensor) -> None:
        """Write [states, numel] window by window to a temporary name, then rename it into
        place: a crash never leaves a half-written state file under the final name."""
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            for row in whole:
                for start in range(0, row.numel(), self.stream_numel):
                    f.write(row[start:start + self.stream_numel].numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _clip(runs: Runs, start: int, end: int) -> Runs:
    """The runs inside [start, end), relative to start."""
    return [(max(a, start) - start, min(b, end) - start) for a, b in runs if a < end and b > start]
