"""The precision policy: the one place every layout reads its dtypes from, and the loss scaler
of fp16 training.

Design (docs/precision.md says why at more length): mixed precision as torch's automatic
mixed precision does it (Micikevicius et al. 2018, "Mixed Precision Training", with the
fp32 copy of the weights being the parameters themselves). For every layout -- DP, ZeRO-1/2/3,
TP/SP, PP, offload:

- parameters are held in fp32 and are the master weights: the optimizer updates them in
  place (no second copy to keep in sync; checkpoints are exact);
- the forward and backward run under autocast in the compute dtype (bf16 or fp16): matmuls
  and attention take rounded copies of the weights and activations, norms, softmax, the
  loss and the residual stream stay fp32;
- gradients arrive in fp32 (the gradient of an fp32 leaf) and micro-batches accumulate in
  fp32 (Megatron's `main_grad`);
- gradients travel in `reduce_dtype` (train.grad_reduce_dtype: fp32, or bf16 to halve the
  bytes) and are averaged back into fp32.

What travels between ranks is what the compute reads, in the compute dtype:

- ZeRO-3 gathers the parameters autocast rounds before every use (linear and expert
  weights, LoRA factors; cost/units.py) already rounded (`gather_dtype`), as FSDP2's
  `param_dtype` does, and the rest (norms, embedding tables, router) in fp32: the rounded
  copy is the one autocast would make, so ZeRO-3 still computes DP's numbers, with half
  the gather bytes for almost every parameter;
- pipeline stages send boundary activations and their gradients in `boundary_dtype`, the
  compute dtype: the fp32 residual stream is rounded once per stage boundary (Megatron's
  boundary is its bf16 residual stream), and upcast on arrival;
- tensor-parallel regions are entered in the compute dtype (tensor/layers.py), so their
  all-gathers, all-reduces and reduce-scatters move 16-bit activations and gradients.

Why fp32 parameters under autocast and not Megatron's bf16 compute parameters: every
layout then runs the same autocast ops on the same fp32 values, so layouts differ only in
the order of fp32 sums and the roundings on the wire listed above, and no layout needs a
second weight copy of its own.

bf16-true and fp16-true (train.precision) are the other design, with no master: parameters,
gradients and every wire dtype 16-bit, no autocast, fp32 optimizer moments; the update is
true16.py's (docs/precision.md, "16-bit training").

fp16 adds dynamic loss scaling (`LossScaler`): the loss of each micro-batch is multiplied by
the scale before backward, the gradients are divided by it before clipping, and a step whose
gradients are not finite is skipped on every rank.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from shardtrain.config import Config
from shardtrain.config.precision import is_true16

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "bf16-true": torch.bfloat16, "fp16-true": torch.float16}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    name: str  # train.precision: fp32 | bf16 | fp16 | bf16-true | fp16-true
    compute_dtype: torch.dtype  # autocast's dtype for matmuls (fp32: no autocast)
    param_dtype: torch.dtype = torch.float32  # held, gathered (ZeRO-3) and updated
    grad_dtype: torch.dtype = torch.float32  # micro-batch accumulation (main gradients)
    reduce_dtype: torch.dtype = torch.float32  # gradients on the wire (dp all-reduce / RS)
    master_dtype: torch.dtype = torch.float32  # the optimizer's weights: the parameters
    residual_dtype: torch.dtype = torch.float32  # the residual stream a pipeline stage passes
    gather_dtype: torch.dtype = torch.float32  # ZeRO-3's gather of autocast-rounded params
    boundary_dtype: torch.dtype = torch.float32  # pipeline activations/gradients on the wire

    @classmethod
    def from_config(cls, cfg: Config) -> PrecisionPolicy:
        t = cfg.train
        compute = DTYPES[t.precision]
        if is_true16(t.precision):  # 16 bits held, no master, no autocast (true16.py)
            return cls(name=t.precision, compute_dtype=compute, param_dtype=compute,
                       grad_dtype=compute, master_dtype=compute, residual_dtype=compute,
                       gather_dtype=compute, boundary_dtype=compute,
                       reduce_dtype=DTYPES[t.grad_reduce_dtype])
        return cls(name=t.precision, compute_dtype=compute, gather_dtype=compute,
                   boundary_dtype=compute, reduce_dtype=DTYPES[t.grad_reduce_dtype])

    @property
    def loss_scaling(self) -> bool:
        """fp16's 5 exponent bits underflow small gradients: the loss is scaled."""
        return self.compute_dtype == torch.float16

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Entered around each forward (the backward follows the dtypes it recorded)."""
        if self.compute_dtype == self.param_dtype:  # fp32, or 16-bit parameters (-true)
            return nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, sec. 3.2; the defaults of Megatron-LM
    and DeepSpeed): start at `initial`; after `growth_interval` steps without overflow, x2;
    an overflow (gradients not finite) skips the step and uses up one of `hysteresis`
    tolerated overflows; once they are used up, each overflow halves the scale (never below
    `min_scale`) until a growth refills the tolerance (Megatron's rule). A static scaler
    (`dynamic=False`: fp32 and bf16) keeps scale 1 but still skips a non-finite step, so no
    precision applies an inf to the weights.

    The one rule for non-finite steps: a step is skipped (`skipped`) when its gradient norm
    or its loss is not finite, and it is *bad* (`bad`: the trainer's guard counts those,
    train/guard.py) when loss scaling does not explain it: any skipped step in fp32 and
    bf16; in fp16 a non-finite loss (the forward's, unscaled: the scale stays put) or an
    overflow with the tolerance used up at the minimum scale (halving cannot help)."""

    def __init__(self, *, dynamic: bool, initial: float = 2.0**16, growth_interval: int = 2000,
                 hysteresis: int = 2, min_scale: float = 1.0):
        self.dynamic, self.growth_interval = dynamic, growth_interval
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.scale = initial if dynamic else 1.0
        self.clean_steps = 0  # steps without overflow since the last change of scale
        self.tolerance = hysteresis  # overflows left before the scale halves
        self.skipped = False  # the last step's verdict
        self.bad = False  # ... and whether loss scaling explains it (class doc)

    def update(self, grad_norm: torch.Tensor, loss: torch.Tensor | None = None) -> bool:
        """After the gradients were unscaled and their norm taken over every group that holds
        gradients (dp, tp, pp: the same value on every rank), with the step's loss averaged
        over the replicas (the same everywhere too), so every rank decides alike: True if
        this step must be skipped. Moves the scale."""
        finite_loss, finite_grad = self.read_flags(grad_norm, loss)
        self.skipped = not (finite_loss and finite_grad)
        self.bad = self.skipped and not (self.dynamic and finite_loss)
        if not self.dynamic or not finite_loss:
            return self.skipped
        if self.skipped:
            self.clean_steps = 0
            self.tolerance -= 1
            if self.tolerance <= 0:
                self.bad = self.scale <= self.min_scale
                self.scale = max(self.scale / 2, self.min_scale)
            return True
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0
            self.tolerance = self.hysteresis
        return False

    @staticmethod
    def read_flags(grad_norm: torch.Tensor, loss: torch.Tensor | None) -> tuple[bool, bool]:
        """(the loss is finite, the gradient norm is finite): both flags are computed on the
        device and read in one transfer, the step's one agreed decision (train/syncs.py
        STEP_SYNCS: the optimizer must know on the host whether it steps)."""
        finite = torch.isfinite(grad_norm.reshape(1))  # [1]
        if loss is not None:  # a parameter server's norm is a host tensor: the loss joins it
            finite_loss = torch.isfinite(loss).all().reshape(1).to(finite.device)
            finite = torch.cat([finite_loss, finite])  # [2]
        flags = finite.tolist()
        return (True if loss is None else flags[0]), flags[-1]

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "tolerance": self.tolerance}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.tolerance = int(state["tolerance"])

    @classmethod
    def from_config(cls, cfg: Config) -> LossScaler:
        s = cfg.loss_scale
        return cls(dynamic=cfg.train.precision in ("fp16", "fp16-true"), initial=s.initial,
                   growth_interval=s.growth_interval, hysteresis=s.hysteresis,
                   min_scale=s.min_scale)

