"""ZeRO++'s bytes per step, run against planner: plain ZeRO-3, each option alone, all three.

    python benchmarks/zeropp_bytes.py [--nproc 4] [--node-size 2] [--out runs/zeropp-bytes]
                                      [--section.field VALUE ...]

Trains the default preset for 3 steps per variant (fp32, what the CPU's train.precision
auto resolves to; ZeRO-3, `--nproc` processes in virtual
nodes of `--node-size`, so hpZ has a node and qgZ takes its two hops) and prints, per
variant, the bytes rank 0 sent in step 2 (the ledger's comm_bytes: every collective of the
step, the loss's and the gradient norm's all-reduces too) next to the planner's ZeRO bytes
for the same config (plan/zeropp.py; `step_ops`' dp group) and the share of those that
travel on groups spanning nodes (hpZ's backward gathers and qgZ's first hop stay inside
one). The seeds' "ZeRO++ cuts traffic ~4x" is the paper's figure for bytes across nodes
(Wang et al. 2023: 3M -> 0.75M with int4 gradients); docs/zero.md compares.
A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compression_default_run import train

from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.layout import config_layout
from shardtrain.plan.zeropp import zeropp_ops

QW, HP, QG = (["--parallel.zero_quantized_weights", "true"], ["--parallel.zero_hpz", "true"],
              ["--parallel.zero_quantized_gradients", "true"])
VARIANTS = {"zero3": [], "qwZ": QW, "hpZ": HP, "qgZ": QG, "qwZ+hpZ+qgZ": QW + HP + QG}
NODE_LOCAL = ("hpz", "int8 node")  # CommOp.what of ops inside one node


def planned(overrides: list[str], nproc: int, node_size: int) -> tuple[float, float]:
    """(the planner's ZeRO bytes per step of rank 0, those on groups spanning nodes):
    zeropp_ops, which step_ops uses for ZeRO++ layouts and which counts plain ZeRO's units
    exactly too (step_ops spreads plain ZeRO's parameters evenly over the layers)."""
    cfg = config.load("default", overrides)
    hw = hardware.get("h100", {"gpus_per_node": str(node_size)})
    ops = zeropp_ops(cfg.model, config_layout(cfg, nproc), hw,
                     bucket_bytes=cfg.comm.bucket_mb * 2**20)
    total = sum(op.bytes_sent for op in ops)
    return total, total - sum(op.bytes_sent for op in ops if op.what in NODE_LOCAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--out", default="runs/zeropp-bytes")
    args, overrides = parser.parse_known_args()
    common = ["--parallel.zero", "3", "--parallel.node_size", str(args.node_size),
              "--train.micro_batch", str(16 // args.nproc), "--train.steps", "3",
              "--train.eval_every", "0", "--train.precision", "fp32", *overrides]
    rows = {}
    for label, extra in VARIANTS.items():
        train("none", extra + common, args.nproc, Path(args.out) / label, [])
        records = [json.loads(line) for line in
                   (Path(args.out) / label / "metrics.jsonl").read_text().splitlines()]
        plan, across = planned(extra + common, args.nproc, args.node_size)
        rows[label] = {"run": records[1]["comm_bytes"], "planner": plan, "across": across}
    base = rows["zero3"]
    print(f"\n{'option':>12} {'planner B/step':>15} {'run B/step':>12} {'vs zero3':>9} "
          f"{'planner across nodes':>21} {'vs zero3':>9}")
    for label, r in rows.items():
        print(f"{label:>12} {r['planner']:15.0f} {r['run']:12.0f} "
              f"{r['run'] / base['run']:9.3f} {r['across']:21.0f} "
              f"{r['across'] / base['across']:9.3f}")
    print(json.dumps({"nproc": args.nproc, "node_size": args.node_size, "rows": rows}))


if __name__ == "__main__":
    main()
