"""What the zero-bubble schedules' split backward costs: B + W of one pipeline stage against
its whole backward, and torch.distributed.pipelining's split of the same stage, on one
process (parallel/pipeline/split_backward.py).

    python benchmarks/split_backward_cost.py [--pp 4] [--stage 1] [--repeats 40]
                                             [--section.field VALUE ...]

The stage is the one our partition cuts from the default model (with --pp 4, give
--model.n_layers 8: two layers per stage, as the pipeline benchmark's), micro-batch 2 of
256 tokens, one thread (a pipeline rank's share of this 2-core machine). Each repetition
runs one forward, then one of: the whole backward, our B then W, torch's
stage_backward_input then stage_backward_weight -- in rotation, so machine noise and
drift hit all alike -- and times the backward alone in this thread's CPU time (less
moved by other processes than wall time). Prints the medians and each split's ratio to
the whole backward. A figure, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from shardtrain import config
from shardtrain.model.transformer import build_model
from shardtrain.parallel.pipeline.split_backward import input_backward, weight_backward
from shardtrain.parallel.pipeline.stage import split_stages
from shardtrain.parallel.tensor.vocab import cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    cfg = config.load("default", ["--parallel.pp", str(args.pp), "--parallel.schedule",
                                  "zb-h1", "--train.micro_batch", "2", *overrides])
    module, chunks = split_stages(build_model(cfg.model, seed=None), cfg, stage=args.stage)
    module.to_empty(device="cpu")
    module.tie_weights()
    module.init_weights(cfg.train.seed)
    chunk, params = chunks[0], list(module.parameters())
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch, cfg.train.seq_len)
    x0 = torch.randint(0, cfg.model.vocab_size, shape, generator=g) if chunk.first else \
        torch.randn(*shape, cfg.model.dim, generator=g)  # tokens, or [B, S, C]
    targets = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    grad = None if chunk.last else torch.randn(*shape, cfg.model.dim, generator=g)
    runs = {
        "whole": lambda x, out: out.backward(grad),
        "ours": lambda x, out: weight_backward(input_backward(out, grad, x)),
        "torch": lambda x, out: stage_backward_weight(iter(params), stage_backward_input(
            [out], None if grad is None else [grad], [x], iter(params))[1]),
    }
    if chunk.first:  # the first stage's input gradient is nobody's: no split there
        raise SystemExit("pick a stage other than the first (--stage)")
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(args.repeats + 3):  # the first 3 rounds warm up
        for name in names[i % 3:] + names[:i % 3]:
            x = x0.detach().requires_grad_()
            out = chunk(x)
            if chunk.last:
                out = cross_entropy(out, targets)
            start = time.thread_time()
            runs[name](x, out)
            if i >= 3:
                times[name].append(time.thread_time() - start)
            module.zero_grad(set_to_none=False)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"pp={args.pp} stage={args.stage} ({len(chunk.indices)} layers"
          f"{', the loss' if chunk.last else ''}), median of {args.repeats}:")
    for name, ms in med.items():
        print(f"  {name:6s} {ms:8.2f} ms  ({ms / med['whole']:.3f} x the whole backward)")


if __name__ == "__main__":
    main()
