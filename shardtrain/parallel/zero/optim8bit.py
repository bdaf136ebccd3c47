"""ZeRO's shard optimizer for `optim.name = adamw8bit`: each rank keeps its shard's Adam
moments 8-bit, block-wise (quant/adam8bit.py; Dettmers et al. 2022).

Block alignment: for this optimizer ZeRO lays out its flat units with every parameter
starting, and every rank's shard sized, at a multiple of the 256-value block (units.py
`align`). A block counted from a shard's start then never straddles two parameters and
covers the same values as the block counted from the parameter's own start in a single
process; the padding between parameters is zero, which changes no block's absmax and
quantizes to exactly 0. So each rank quantizes exactly the blocks the single-process
optimizer quantizes, and a ZeRO run reproduces it. Parameters under 4096 values keep fp32
moments as they do there: their runs are kept beside the codes and override them.
"""

from __future__ import annotations

import torch

from shardtrain.config import OptimConfig
from shardtrain.parallel.strategy import nbytes
from shardtrain.parallel.zero.optim import Runs
from shardtrain.quant.adam8bit import adamw8bit_update
from shardtrain.quant.blockwise import BLOCK, Quantized, dequantize, quantize_

STATE_NAMES = ("m_codes", "m_absmax", "v_codes", "v_absmax", "m_small", "v_small")


class Adam8bitShardOptimizer:
    """A ShardOptimizer (zero/optim.py) with 8-bit moments. `small`: per shard, the runs
    of the parameters that keep fp32 moments."""

    def __init__(self, masters: list[torch.Tensor], decay: list[Runs], small: list[Runs],
                 optim: OptimConfig, *, aliased: bool):
        self.masters, self.decay, self.optim, self.aliased = masters, decay, optim, aliased
        self.index = []  # per shard: the element indices of its small parameters [k]
        self.state: list[dict[str, torch.Tensor]] = []
        for master, runs in zip(masters, small, strict=True):
            n, device = master.numel(), master.device
            if n % BLOCK:
                raise ValueError(f"an 8-bit optimizer shard of {n} values is not block-aligned")
            idx = torch.cat([torch.arange(a, b, device=device) for a, b in runs]) if runs \
                else torch.zeros(0, dtype=torch.long, device=device)
            m, v = Quantized.zeros(n, True, device), Quantized.zeros(n, False, device)
            self.index.append(idx)
            self.state.append({"m_codes": m.codes, "m_absmax": m.absmax, "v_codes": v.codes,
                               "v_absmax": v.absmax, "m_small": torch.zeros(idx.numel(), device=device),
                               "v_small": torch.zeros(idx.numel(), device=device)})
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], params: list[torch.Tensor], lr: float) -> None:
        self.steps += 1
        o = self.optim
        for master, state, idx, grad, decay, param in zip(
                self.masters, self.state, self.index, grads, self.decay, params, strict=True):
            for a, b in decay:  # decoupled weight decay on matrices, before the moments
                master[a:b].mul_(1 - lr * o.weight_decay)
            mq = Quantized(state["m_codes"], state["m_absmax"], True)
            vq = Quantized(state["v_codes"], state["v_absmax"], False)
            moments = {"exp_avg": dequantize(mq), "exp_avg_sq": dequantize(vq)}
            moments["exp_avg"][idx] = state["m_small"]
            moments["exp_avg_sq"][idx] = state["v_small"]
            adamw8bit_update(master, grad.float(), moments, lr=lr, beta1=o.beta1, beta2=o.beta2,
                             eps=o.eps, weight_decay=0.0, step=self.steps)
            state["m_small"].copy_(moments["exp_avg"][idx])
            state["v_small"].copy_(moments["exp_avg_sq"][idx])
            quantize_(mq, moments["exp_avg"])
            quantize_(vq, moments["exp_avg_sq"])
            if not self.aliased:
                param.copy_(master)

    def state_dict(self) -> dict:
        return {"steps": self.steps,
                "shards": [{"master": m.detach().clone(), **{k: t.clone() for k, t in s.items()}}
                           for m, s in zip(self.masters, self.state)]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for master, mine, saved in zip(self.masters, self.state, state["shards"], strict=True):
            master.copy_(saved["master"])
            for name in STATE_NAMES:
                mine[name].copy_(saved[name])

    def shard_state(self, k: int) -> dict[str, torch.Tensor]:
        """Fresh fp32 tensors: the moments dequantized, the small parameters' own put in."""
        state, idx, out = self.state[k], self.index[k], {"master": self.masters[k]}
        for name, short, signed in (("exp_avg", "m", True), ("exp_avg_sq", "v", False)):
            full = dequantize(Quantized(state[f"{short}_codes"], state[f"{short}_absmax"], signed))
            full[idx] = state[f"{short}_small"]
            out[name] = full
        return out

    @torch.no_grad()
    def load_shard_state(self, k: int, saved: dict[str, torch.Tensor]) -> None:
        """Quantized again: exact for moments this layout's blocks wrote (a block's absmax
        is one of its values, and every value is a code times it)."""
        state, idx = self.state[k], self.index[k]
        self.masters[k].copy_(saved["master"])
        for name, short, signed in (("exp_avg", "m", True), ("exp_avg_sq", "v", False)):
            values = saved[name].to(self.masters[k].device, torch.float32)
            quantize_(Quantized(state[f"{short}_codes"], state[f"{short}_absmax"], signed), values)
            state[f"{short}_small"].copy_(values[idx])

    def master(self, k: int) -> torch.Tensor:
        return self.masters[k]

    def memory(self) -> dict[str, int]:
        master = 0 if self.aliased else nbytes(*self.masters)
        moments = nbytes(*(t for s in self.state for t in s.values()))
        return {"master_bytes": master, "optimizer_bytes": moments, "offloaded_bytes": 0}
