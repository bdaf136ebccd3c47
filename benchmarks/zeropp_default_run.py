"""ZeRO++ on the default run: ZeRO-3 unquantized, then each ZeRO++ option on its own.

    python benchmarks/zeropp_default_run.py [--nproc 4] [--node-size 2] [--out runs/zeropp]
                                            [--section.field VALUE ...]

Runs `shardtrain train` (the default preset, `parallel.zero = 3`) once per variant with the
same seed and data: unquantized, `zero_quantized_weights` (qwZ), `zero_hpz` (hpZ) and
`zero_quantized_gradients` (qgZ). hpZ only means something when a dp group spans several
nodes, so the runs use virtual nodes of `--node-size` ranks (4 processes in nodes of 2 by
default; micro-batches of 4 keep the default global batch of 16). Prints each run's final
eval loss, its ratio to the unquantized run's, and the bytes rank 0 sent per step (the
ledger's comm_bytes); the last line is one JSON object.
A figure, never a test: each run takes several minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compression_default_run import train

VARIANTS = (("zero3", []),
            ("qwZ", ["--parallel.zero_quantized_weights", "true"]),
            ("hpZ", ["--parallel.zero_hpz", "true"]),
            ("qgZ", ["--parallel.zero_quantized_gradients", "true"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--out", default="runs/zeropp")
    args, overrides = parser.parse_known_args()
    # micro_batch 4: the default run's global batch of 16 sequences, one micro-batch per rank
    # on 4 ranks.
    common = ["--parallel.zero", "3", "--parallel.node_size", str(args.node_size),
              "--train.micro_batch", "4", *overrides]
    results = {label: train("none", extra + common, args.nproc, Path(args.out) / label, [])
               for label, extra in VARIANTS}
    base = results["zero3"]
    print(f"\n{'variant':>8} {'eval loss':>10} {'vs zero3':>9} {'train loss':>11} "
          f"{'bytes/step':>12}")
    summary = {}
    for label, r in results.items():
        ratio = r["final_eval_loss"] / base["final_eval_loss"]
        summary[label] = {**r, "eval_loss_ratio": ratio}
        print(f"{label:>8} {r['final_eval_loss']:10.4f} {ratio:9.4f} "
              f"{r['last10_train_loss']:11.4f} {r['comm_bytes_per_step']:12.0f}")
    print(json.dumps({"nproc": args.nproc, "node_size": args.node_size, "runs": summary}))


if __name__ == "__main__":
    main()
