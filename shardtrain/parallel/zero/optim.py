"""The optimizer of ZeRO's flat shards: the `ShardOptimizer` interface, the update arithmetic,
and the in-memory implementation.

ZeRO (Rajbhandari et al. 2020, sec. 5.1) gives each data-parallel rank the optimizer state
and fp32 master weights of 1/N_d of every flat unit; the rank updates only that slice. A
shard optimizer sees lists (one entry per unit) of:
- `grads`: fp32 gradient shards [shard], already averaged over dp and clipped;
- `params`: the compute copies of the same slices [shard], any float dtype: after the
  update it writes the new values there (for fp32 runs the param shard *is* the master, and
  the write is skipped).
Where the state lives is the implementation's business: `MemoryOptimizer` keeps it beside
the model; `offload.HostOptimizer` keeps it in host memory or NVMe files (ZeRO-Offload,
ZeRO-Infinity). `update_shard` is the arithmetic both use: torch.optim's single-tensor AdamW,
SGD, RMSprop and Adagrad, op for op, so a sharded step equals the single-process
`torch.optim` step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardtrain.config import OptimConfig
from shardtrain.parallel.strategy import nbytes
from shardtrain.parallel.true16 import round_seed, update_16bit

Runs = list[tuple[int, int]]  # [start, end) element ranges of a shard


class ShardOptimizer(Protocol):
    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        """One optimizer step of every shard; writes the new values into `params`."""

    def state_dict(self) -> dict:
        """This rank's state: {"steps", "shards": [{name: fp32 [shard]}]} (master included)."""

    def load_state_dict(self, state: dict) -> None: ...

    def shard_state(self, k: int) -> dict[str, torch.Tensor]:
        """Shard k's state as fp32 [shard] tensors: "master" and the moments by their torch
        names (8-bit moments dequantized): the layout-independent form checkpoints keep."""

    def load_shard_state(self, k: int, state: dict[str, torch.Tensor]) -> None: ...

    def master(self, k: int) -> torch.Tensor:
        """Shard k's fp32 master weights [shard] (may be a copy)."""

    def memory(self) -> dict[str, int]:
        """Bytes held: {"master_bytes", "optimizer_bytes"} on the device, "offloaded_bytes"
        in host memory or files."""


def moment_names(optim: OptimConfig) -> tuple[str, ...]:
    """The per-element state besides the master weights: fp32 moments, and under
    optim.bf16_update=kahan (bf16-true only) the bf16 compensation last."""
    kahan = ("compensation",) if optim.bf16_update == "kahan" else ()  # bf16 (true16.py)
    if optim.name == "adamw":
        return ("exp_avg", "exp_avg_sq") + kahan
    if optim.name in ("rmsprop", "adagrad"):  # torch's state names
        return (("square_avg",) if optim.name == "rmsprop" else ("sum",)) + kahan
    return (("momentum_buffer",) if optim.momentum else ()) + kahan


@torch.no_grad()
def update_shard(master: torch.Tensor, moments: list[torch.Tensor], grad: torch.Tensor,
                 decay: Runs, lr: float, steps: int, optim: OptimConfig) -> None:
    """One step on one fp32 slice: master [n], moments (see moment_names) [n] each, grad [n];
    `decay` the runs where weight decay applies (matrices, as train/optim.py groups them);
    `steps` counts this step (Adam's bias correction). torch.optim's single-tensor path."""
    o = optim
    if o.name == "adamw":
        exp_avg, exp_avg_sq = moments
        for a, b in decay:  # decoupled weight decay (Loshchilov and Hutter 2019)
            master[a:b].mul_(1 - lr * o.weight_decay)
        exp_avg.lerp_(grad, 1 - o.beta1)
        exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, value=1 - o.beta2)
        step_size = lr / (1 - o.beta1 ** steps)
        denom = (exp_avg_sq.sqrt() / (1 - o.beta2 ** steps) ** 0.5).add_(o.eps)
        master.addcdiv_(exp_avg, denom, value=-step_size)
        return
    if decay and o.weight_decay:  # SGD, RMSprop, Adagrad: L2 into the gradient, as torch
        grad = grad.clone()
        for a, b in decay:
            grad[a:b].add_(master[a:b], alpha=o.weight_decay)
    if o.name == "rmsprop":  # square_avg: running mean of grad^2 (Tieleman and Hinton 2012)
        square_avg, = moments
        square_avg.mul_(o.rms_alpha).addcmul_(grad, grad, value=1 - o.rms_alpha)
        master.addcdiv_(grad, square_avg.sqrt().add_(o.eps), value=-lr)
        return
    if o.name == "adagrad":  # sum: every grad^2 so far (Duchi et al. 2011)
        total, = moments
        total.addcmul_(grad, grad, value=1)
        master.addcdiv_(grad, total.sqrt().add_(o.eps),
                        value=-lr / (1 + (steps - 1) * o.adagrad_lr_decay))
        return
    if o.momentum:
        buf, = moments  # zeros before the first step, so the first is buf = grad exactly
        buf.mul_(o.momentum).add_(grad)
        grad = buf
    master.add_(grad, alpha=-lr)


class MemoryOptimizer:
    """Master weights and moments beside the model, on its device. `masters[k]` may alias
    the parameter shard (fp32 runs: the parameters are the master weights) and is then
    updated in place."""

    def __init__(self, masters: list[torch.Tensor], decay: list[Runs], optim: OptimConfig,
                 *, aliased: bool, seed: int = 0):
        self.masters, self.decay, self.optim, self.aliased = masters, decay, optim, aliased
        self.names, self.seed = moment_names(optim), seed
        # 16-bit masters (bf16-true, fp16-true): the shards themselves, updated through
        # true16.py; the moments stay fp32, kahan's compensation in the masters' dtype
        self.moments = [[torch.zeros_like(m, dtype=m.dtype if n == "compensation"
                                          else torch.float32) for n in self.names]
                        for m in masters]
        self.steps = 0

    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        self.steps += 1
        for k, (master, moments, grad, decay, param) in enumerate(zip(
                self.masters, self.moments, grads, self.decay, params, strict=True)):
            if master.dtype != torch.float32:  # bf16-true, fp16-true (true16.py)
                kahan = self.names[-1:] == ("compensation",)
                fp32 = moments[:-1] if kahan else moments

                def fp32_step(w: torch.Tensor, fp32=fp32, grad=grad, decay=decay) -> None:
                    update_shard(w, fp32, grad.float(), decay, lr, self.steps, self.optim)
                update_16bit(master, fp32_step, mode=self.optim.bf16_update,
                             seed=round_seed(self.seed, self.steps, k),
                             compensation=moments[-1] if kahan else None)
            else:
                update_shard(master, moments, grad, decay, lr, self.steps, self.optim)
            if not self.aliased:
                param.copy_(master)

    def state_dict(self) -> dict:
        return {"steps": self.steps,
                "shards": [{"master": m.detach().clone(),
                            **{n: t.clone() for n, t in zip(self.names, moments)}}
                           for m, moments in zip(self.masters, self.moments)]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for master, moments, saved in zip(self.masters, self.moments, state["shards"],
                                          strict=True):
            master.copy_(saved["master"])
            for name, t in zip(self.names, moments):
                t.copy_(saved[name])

    def shard_state(self, k: int) -> dict[str, torch.Tensor]:
        return {"master": self.masters[k], **dict(zip(self.names, self.moments[k]))}

    @torch.no_grad()
    def load_shard_state(self, k: int, state: dict[str, torch.Tensor]) -> None:
        for name, t in self.shard_state(k).items():
            t.copy_(state[name])

    def master(self, k: int) -> torch.Tensor:
        return self.masters[k]

    def memory(self) -> dict[str, int]:
        master = 0 if self.aliased else nbytes(*self.masters)
        moments = nbytes(*(t for ms in self.moments for t in ms))
        return {"master_bytes": master, "optimizer_bytes": moments, "offloaded_bytes": 0}

