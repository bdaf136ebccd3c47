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

HostOptimizer implements shard_optim.ShardOptimizer, and its update is that module's
`update_shard` (torch.optim's own arithmetic, op for op), so an offloaded run reproduces an
on-device one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardtrain.config import Config, ConfigError, OptimConfig
from shardtrain.parallel.zero.optim import (MemoryOptimizer, Runs, ShardOptimizer, moment_names,
                                             update_shard)
from shardtrain.cost.counts import param_counts

STREAM_NUMEL = 1 << 20  # elements per streamed window: 4 MiB of each fp32 state


def state_names(optim: OptimConfig) -> tuple[str, ...]:
    """The fp32 tensors kept per parameter element: the master weight, then the moments."""
    return ("master", *moment_names(optim))


def offload_bytes(numel: int, optim: OptimConfig) -> int:
    """Bytes of host (cpu) or file (nvme) state for `numel` fp32 master elements."""
    return 4 * numel * len(state_names(optim))


def check_offload_space(cfg: Config) -> None:
    """Before launch (cli.prepare_run): with nvme offload, the directory must hold every
    rank's state files, (1 + moments) x 4 bytes per parameter in all."""
    if cfg.parallel.offload == "nvme":
        check_offload_dir(cfg.parallel.offload_dir,
                          offload_bytes(param_counts(cfg.model).total, cfg.optim))


def check_offload_dir(directory: str, needed_bytes: int) -> None:
    """nvme offload: the directory must exist, be writable, and have room for the state
    of every rank that shares it (`needed_bytes`). ConfigError naming the field otherwise."""
    field = f"parallel.offload_dir={directory!r}"
    if not directory:
        raise ConfigError("parallel.offload=nvme needs parallel.offload_dir: a directory on a "
                          "fast local disk for the optimizer state files")
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"{field} does not exist; create it (mkdir -p) or point "
                          "parallel.offload_dir at an existing directory")
    try:  # a real write: permission bits say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"{field} is not writable ({e.strerror}); choose a directory you "
                          "can write to") from None
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ConfigError(
            f"{field} has {free / 2**20:.1f} MiB free, but the offloaded optimizer state "
            f"needs {needed_bytes / 2**20:.1f} MiB; free space there or choose a larger disk")


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
        return MemoryOptimizer(masters, decay, cfg.optim, aliased=aliased)
    return HostOptimizer(masters, decay, cfg.optim, offload=p.offload, directory=p.offload_dir,
                         rank=rank)


@dataclass
class _Shard:
    numel: int
    decay: Runs  # where weight decay applies
    host: torch.Tensor | None = None  # cpu: [states, numel] fp32
    path: Path | None = None  # nvme: the state file, [states, numel] fp32
    grad: torch.Tensor | None = None  # cpu on a CUDA device: pinned staging for the gradient


class HostOptimizer:
    """A ShardOptimizer (AdamW or SGD) whose fp32 master shards and moments live on the host
    (`cpu`) or in files (`nvme`).

    `masters`: each shard's initial values (copied; any device); `decay`: each shard's
    weight-decay runs (FlatUnit.decay_runs). `step(grads, params, lr)` writes the new values
    into `params`, the device shards (any float dtype)."""

    def __init__(self, masters: list[torch.Tensor], decay: list[Runs],
                 optim: OptimConfig, *, offload: str, directory: str = "", rank: int = 0,
                 stream_numel: int = STREAM_NUMEL):
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"parallel.offload={offload!r}: HostOptimizer serves cpu or nvme")
        self.optim, self.offload, self.stream_numel = optim, offload, stream_numel
        self.states = state_names(optim)
        self.steps = 0  # optimizer steps taken (Adam's bias correction)
        self.directory: Path | None = None
        cuda = any(m.is_cuda for m in masters)
        # The host <-> device copies' own stream (cpu offload on CUDA; None elsewhere).
        self.stream = torch.cuda.Stream(masters[0].device) if cuda and offload == "cpu" \
            else None
        if offload == "nvme":
            check_offload_dir(directory, offload_bytes(sum(m.numel() for m in masters), optim))
            self.directory = Path(tempfile.mkdtemp(prefix=f"shardtrain-rank{rank}-",
                                                   dir=directory))
            # The files go when this optimizer does (or at interpreter exit).
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.shards: list[_Shard] = []
        for k, (master, runs) in enumerate(zip(masters, decay, strict=True)):
            shard = _Shard(numel=master.numel(), decay=runs)
            init = torch.zeros(len(self.states), shard.numel, dtype=torch.float32, device="cpu")
            init[0] = master.detach().reshape(-1).float().cpu()  # [states, numel]
            if offload == "cpu":
                shard.host = init.pin_memory() if cuda else init
                if cuda:
                    shard.grad = torch.empty(shard.numel, dtype=torch.float32,
                                             device="cpu").pin_memory()
            else:
                shard.path = self.directory / f"unit{k:04d}.fp32"
                self._write_file(shard.path, init)
            self.shards.append(shard)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        self.steps += 1
        if self.offload == "cpu":
            self._step_cpu(grads, params, lr)
            return
        for shard, grad, param in zip(self.shards, grads, params, strict=True):
            g, p = grad.reshape(-1), param.view(-1)
            for start, end, window in self._windows(shard):  # window: states x [end - start]
                update_shard(window[0], window[1:], g[start:end].float().cpu(),
                             _clip(shard.decay, start, end), lr, self.steps, self.optim)
                p[start:end].copy_(window[0])
                del window  # unmaps it: one window of each state is mapped at a time

    def _step_cpu(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        if self.stream is None:  # host tensors only: plain copies
            for shard, grad, param in zip(self.shards, grads, params, strict=True):
                update_shard(shard.host[0], list(shard.host[1:]), grad.reshape(-1).float(),
                             shard.decay, lr, self.steps, self.optim)
                param.view(-1).copy_(shard.host[0])
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)  # the gradient shards are final on the compute stream
        events = []
        with torch.cuda.stream(self.stream):
            for shard, grad in zip(self.shards, grads, strict=True):  # every gradient down
                shard.grad.copy_(grad.reshape(-1), non_blocking=True)
                grad.record_stream(self.stream)  # not reused before the copy is done
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
            for shard, param, event in zip(self.shards, params, events, strict=True):
                event.synchronize()  # this shard's gradient is on the host
                update_shard(shard.host[0], list(shard.host[1:]), shard.grad, shard.decay, lr,
                             self.steps, self.optim)
                # Pinned source on the copy stream: the upload overlaps the next update, and
                # the next step's update of this host buffer waits behind it (stream order).
                param.view(-1).copy_(shard.host[0], non_blocking=True)
        compute.wait_stream(self.stream)  # the next forward reads the new parameters

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """{"steps", "shards": [{state name: fp32 [numel]}]}: whole tensors (checkpoints)."""
        return {"steps": self.steps,
                "shards": [dict(zip(self.states, self._read(s).clone().unbind(0)))
                           for s in self.shards]}

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
        return dict(zip(self.states, self._read(self.shards[k]).unbind(0)))

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

    def memory(self) -> dict[str, int]:
        """Nothing on the device; the whole state in host memory (cpu) or files (nvme)."""
        held = sum(4 * s.numel * len(self.states) for s in self.shards)
        return {"master_bytes": 0, "optimizer_bytes": 0, "offloaded_bytes": held}

    def close(self) -> None:
        """Delete the nvme state files now (otherwise when this object is collected)."""
        if self.directory is not None:
            self._cleanup()

    # ------------------------------------------------------------------ files

    def _read(self, shard: _Shard) -> torch.Tensor:
        if shard.host is not None:
            return shard.host
        whole = torch.empty(len(self.states), shard.numel, device="cpu")  # host: read from files
        for start, end, window in self._windows(shard):
            whole[:, start:end] = torch.stack(window)
        return whole

    def _windows(self, shard: _Shard):
        """(start, end, [each state's mapped [end - start] fp32 window])."""
        for start in range(0, shard.numel, self.stream_numel):
            end = min(shard.numel, start + self.stream_numel)
            yield start, end, [self._map(shard, i, start, end) for i in range(len(self.states))]

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
