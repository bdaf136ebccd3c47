"""`shardtrain schedule --schedule S --pp P --microbatches M [--virtual V] [--costs F,B,W]
[--json]`: a schedule drawn as the simulator replays it (simulate.py) -- one row per rank,
one column per time unit, each cell the action there (F3 the forward of micro-batch 3, B3
its backward, W3 its weight-gradient pass; F3.1 on chunk 1; F3&B1 an overlapped pair; '.'
idle) -- with the bubble fraction and each rank's peak activations. `--json` prints one
document instead (`bubble_fraction`, `idle`, `peak_activations`, `timelines`)."""

from __future__ import annotations

import argparse
import json

from shardtrain.config import ConfigError
from shardtrain.parallel.pipeline.schedules import SCHEDULES, V_SHAPED
from shardtrain.parallel.pipeline.simulate import Costs, Deadlock, grid, simulate


def parse_costs(text: str) -> Costs:
    try:
        f, b, w = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--costs {text!r}: three numbers F,B,W (a forward, a whole "
                          "backward, its weight part), e.g. 1,2,1") from None
    if f <= 0 or b <= 0 or not 0 <= w < b:
        raise ConfigError(f"--costs {text!r}: F and B must be > 0 and 0 <= W < B (W is the "
                          "weight-gradient part of the whole backward B)")
    return Costs(f=f, b=b, w=w)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain schedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", required=True, choices=SCHEDULES)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--virtual", type=int, default=None,
                        help="chunks per rank (default: 2 for interleaved, zbv, dualpipev; "
                             "else 1)")
    parser.add_argument("--costs", default="1,2,1", help="F,B,W (default 1,2,1)")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    v = args.virtual or (2 if args.schedule in (*V_SHAPED, "interleaved") else 1)
    if args.pp < 1 or args.microbatches < 1:
        raise ConfigError(f"--pp {args.pp} --microbatches {args.microbatches}: both >= 1")
    costs = parse_costs(args.costs)
    try:
        sim = simulate(args.schedule, args.pp, args.microbatches, v, costs)
    except Deadlock as e:
        raise ConfigError(f"schedule {args.schedule}: {e}") from None
    except ValueError as e:  # the builder's own constraint (pp, m, v)
        raise ConfigError(f"--schedule {args.schedule} --pp {args.pp} --microbatches "
                          f"{args.microbatches} --virtual {v}: {e}") from None
    if args.json:
        print(json.dumps({"schedule": args.schedule, "microbatches": args.microbatches,
                          "costs": [costs.f, costs.b, costs.w], **sim.to_dict()}))
        return 0
    print(f"{args.schedule}: pp={args.pp}, m={args.microbatches}, v={v}, "
          f"F={costs.f:g} B={costs.b:g} W={costs.w:g} per chunk")
    print("\n".join(grid(sim)))
    print(f"bubble fraction {sim.bubble_fraction:.1%} (idle per rank "
          f"{', '.join(f'{x:g}' for x in sim.idle)} of {sim.span:g})")
    print("peak activations (micro-batches of the rank's layers): "
          + ", ".join(f"rank {s} {x:g}" for s, x in enumerate(sim.peak_activations)))
    return 0
