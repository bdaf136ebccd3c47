"""How far 8-bit AdamW's updates are from fp32 AdamW's on the default run's own gradients,
and which moment the error comes from.

    python benchmarks/adam8bit_fidelity.py [--steps 150] [--section.field VALUE ...]

Trains the default run (one process, torch AdamW) for `--steps` steps and, at every
optimizer step, feeds the same clipped gradients to several moment recursions kept beside
it: fp32 Adam (the reference), the shipped 8-bit one (quant/adam8bit.py: both moments
block-wise on the dynamic map), the first moment 8-bit only, the second moment 8-bit only,
and the second moment stored as sqrt(v) on the unsigned map (the experiment of
docs/finetuning.md). The weights follow AdamW alone, so the comparison is free of the
trajectories drifting apart (which a whole 8-bit run mixes in). Printed per variant: the
relative error of the update direction, ||u - u_fp32|| / ||u_fp32|| with
u = m_hat / (sqrt(v_hat) + eps), over all quantized tensors, averaged over step windows,
then per weight kind with the mean log ratio of stored sqrt(v) to fp32 sqrt(v) (its bias).
A figure, never a test.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from adam8bit_default_run import one_process_trainer

from shardtrain.quant.adam8bit import MIN_QUANTIZED_NUMEL
from shardtrain.quant.blockwise import Quantized, dequantize, quantize_

Store = Callable[[torch.Tensor], torch.Tensor]  # what a moment [n] reads back as next step


def eight_bit(signed: bool) -> Store:
    def store(x: torch.Tensor) -> torch.Tensor:
        q = Quantized.zeros(x.numel(), signed, x.device)
        quantize_(q, x)
        return dequantize(q)
    return store


def exact(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def as_root(x: torch.Tensor) -> torch.Tensor:
    return eight_bit(False)(x.sqrt()).square()


VARIANTS: dict[str, tuple[Store, Store]] = {  # name: (first moment, second moment)
    "8-bit m and v (shipped)": (eight_bit(True), eight_bit(False)),
    "8-bit m, fp32 v": (eight_bit(True), exact),
    "fp32 m, 8-bit v": (exact, eight_bit(False)),
    "8-bit m, sqrt(v) stored": (eight_bit(True), as_root),
}


class Replay:
    """Moment recursions of every variant, fed the gradients AdamW steps with."""

    def __init__(self, beta1: float, beta2: float, eps: float):
        self.beta1, self.beta2, self.eps, self.step = beta1, beta2, eps, 0
        self.state: dict[tuple[str, str], list[torch.Tensor]] = {}  # (variant, param): [m, v]
        self.errors: dict[str, list[float]] = defaultdict(list)  # variant: per step
        self.kinds: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])

    def moments(self, key: tuple[str, str], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's fp32 moments of one recursion from its stored ones and the gradient g [n]."""
        m, v = self.state.setdefault(key, [torch.zeros_like(g), torch.zeros_like(g)])
        return m.lerp(g, 1 - self.beta1), v * self.beta2 + (1 - self.beta2) * g * g

    def update(self, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        bias1, bias2 = 1 - self.beta1 ** self.step, 1 - self.beta2 ** self.step
        return (m / bias1) / (v.sqrt() / math.sqrt(bias2) + self.eps)

    @torch.no_grad()
    def __call__(self, grads: dict[str, torch.Tensor]) -> None:
        self.step += 1
        err = defaultdict(float)
        ref_norm = 0.0
        for name, g in grads.items():
            if g.numel() < MIN_QUANTIZED_NUMEL:  # fp32 moments in every variant
                continue
            g = g.float().reshape(-1)
            m32, v32 = self.moments(("fp32", name), g)
            self.state["fp32", name] = [m32, v32]
            ref = self.update(m32, v32)
            ref_sq = ref.square().sum().item()
            ref_norm += ref_sq
            kind = name.split(".")[-2] if "." in name else name  # layers.0.mlp.w2.weight: w2
            for variant, (store_m, store_v) in VARIANTS.items():
                m, v = self.moments((variant, name), g)
                e = (self.update(m, v) - ref).square().sum().item()
                err[variant] += e
                stats = self.kinds[variant, kind]
                stats[0] += e
                stats[1] += ref_sq
                tiny = torch.finfo(torch.float32).tiny  # a v stored as 0 counts, not as -inf
                stats[2] += (v.sqrt().clamp_min(tiny) / v32.sqrt().clamp_min(tiny)).log().mean().item()
                stats[3] += 1
                self.state[variant, name] = [store_m(m), store_v(v)]
        for variant in VARIANTS:
            self.errors[variant].append(math.sqrt(err[variant] / ref_norm))

    def report(self) -> None:
        steps = len(next(iter(self.errors.values())))
        windows = [(a, min(b, steps)) for a, b in ((0, 20), (20, 60), (60, steps)) if a < steps]
        heads = "  ".join(f"steps {a + 1}-{b}" for a, b in windows)
        print(f"relative update error ||u - u_fp32|| / ||u_fp32||, mean over: {heads}")
        for variant, errs in self.errors.items():
            cells = "  ".join(f"{sum(errs[a:b]) / (b - a):.4f}" for a, b in windows)
            print(f"  {variant:28s} {cells}")
        print("per weight kind: relative update error / mean log(stored sqrt(v) / fp32 sqrt(v))")
        for variant in VARIANTS:
            cells = ", ".join(f"{kind} {math.sqrt(s[0] / s[1]):.3f}/{s[2] / s[3]:+.4f}"
                              for (v, kind), s in self.kinds.items() if v == variant)
            print(f"  {variant}: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args, overrides = parser.parse_known_args()
    with one_process_trainer(["--train.eval_every", "0", "--optim.name", "adamw",
                              *overrides]) as trainer:
        names = {p: n for n, p in trainer.parallel.module.named_parameters()}
        o = trainer.cfg.optim
        replay = Replay(o.beta1, o.beta2, o.eps)

        def before_step(optimizer: torch.optim.Optimizer, *_) -> None:
            replay({names[p]: p.grad for group in optimizer.param_groups
                    for p in group["params"] if p.grad is not None})

        register_optimizer_step_pre_hook(before_step)
        for _ in range(args.steps):
            trainer.train_step()
    replay.report()


if __name__ == "__main__":
    main()
