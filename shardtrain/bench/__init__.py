"""`shardtrain bench comm | calibrate`: measure collectives and this machine.

    shardtrain bench comm [--nproc 4] [--ops OP ...] [--algorithms NAME ...]
                          [--min-bytes 1K] [--max-bytes 256M] [--factor 4] [--node-size N]
                          [--repeats 5] [--json FILE.json | --json -]
                          [--plot FILE.png | --plot none]
    shardtrain bench calibrate [--nproc 4] [--output FILE.json] [--max-bytes 64M]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from shardtrain.cost import collectives as cost
from shardtrain.comm.dispatch import ALGORITHMS

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("comm", "calibrate"):
        print(__doc__, file=sys.stderr if argv else sys.stdout)
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    return (bench_comm if argv[0] == "comm" else calibrate)(argv[1:])


def _bytes(text: str) -> int:
    try:
        return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS \
            else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1K, 16M or 4096") from None


def _sizes(low: int, high: int, factor: int) -> tuple[int, ...]:
    out = [low]
    while out[-1] * factor <= high:
        out.append(out[-1] * factor)
    return tuple(out)


def _run(args, ops, algorithms, measure_flops: bool = False) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardtrain.bench.comm import Spec, worker
    from shardtrain.launch import launch_local

    if args.nproc < 2:
        raise SystemExit(f"shardtrain bench: --nproc {args.nproc} must be >= 2")
    node = args.node_size or (args.nproc // 2 if args.nproc % 2 == 0 else args.nproc)
    spec = Spec(ops=tuple(ops), algorithms=tuple(algorithms), node_size=node,
                sizes=_sizes(args.min_bytes, args.max_bytes, args.factor),
                repeats=args.repeats, measure_flops=measure_flops)
    try:
        return launch_local(args.nproc, worker, spec)[0]
    except ChildFailedError as e:
        raise SystemExit(f"shardtrain bench: a worker failed:\n{e}") from None


def _common(parser: argparse.ArgumentParser, max_bytes: str) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--min-bytes", type=_bytes, default=_bytes("1K"))
    parser.add_argument("--max-bytes", type=_bytes, default=_bytes(max_bytes))
    parser.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    parser.add_argument("--node-size", type=int, default=0,
                        help="ranks per virtual node (default nproc/2: two nodes)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per measurement at least; the median counts "
                             "(default 5)")


def bench_comm(argv: list[str]) -> int:
    from shardtrain.bench import report

    parser = argparse.ArgumentParser(prog="shardtrain bench comm")
    _common(parser, "256M")
    parser.add_argument("--ops", nargs="+", choices=cost.OPS, default=list(cost.OPS))
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--json", metavar="FILE", default="",
                        help="also write every measurement as one JSON document to FILE "
                             "('-': to stdout, instead of the tables)")
    parser.add_argument("--plot", default="runs/bench/comm_busbw.png",
                        help="PNG of busbw vs size per algorithm ('none': no plot)")
    args = parser.parse_args(argv)
    result = _run(args, args.ops, args.algorithms)
    rows = report.annotate(result)
    figures = report.acceptance(rows)
    message = report.plot(rows, args.plot) if args.plot != "none" else ""
    if args.json:
        doc = json.dumps({**{k: v for k, v in result.items() if k != "link"},
                          "link": dataclasses.asdict(result["link"]), "acceptance": figures},
                         indent=1)
        if args.json == "-":  # asked for on stdout: the document alone, for a pipe
            print(doc)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(doc + "\n")
            message = "\n".join(filter(None, [message, f"json: {args.json}"]))
    if args.json != "-":
        report.print_tables(rows)
        report.print_summary(result, figures)
    if message:
        print(message, file=sys.stderr)
    return 0


def calibrate(argv: list[str]) -> int:
    """fp32 matmul FLOP/s per process, alpha/beta/gamma fitted from a comm bench of the
    fitted algorithms at --nproc processes (native's latency and staging from the backend's
    own calls), and the training-step efficiency of a reference transformer
    (train/start/calibrate.py), saved where the planner's `cpu` preset reads; and the
    runtime base the CPU dry run's predicted peak adds (calibrate.py `runtime_base`)."""
    import torch

    from shardtrain.bench import fit
    from shardtrain.cost import calibration
    from shardtrain.train.start.calibrate import measure_compute, measure_runtime_bytes

    parser = argparse.ArgumentParser(prog="shardtrain bench calibrate")
    _common(parser, "64M")
    parser.add_argument("--output", default=None,
                        help=f"calibration file (default {calibration.DEFAULT_PATH})")
    args = parser.parse_args(argv)
    args.min_bytes = max(args.min_bytes, 4 * 2**10)
    result = _run(args, ("all_reduce", "all_gather", "reduce_scatter", "broadcast"),
                  (*fit.FITTED, "native"), measure_flops=True)
    link = result["link"]
    _, efficiency = measure_compute()  # a ratio: measured here, once, on all threads
    cal = calibration.Calibration(
        flops_per_s=result["flops_per_s"], alpha_s=link.alpha_s,
        beta_s_per_byte=link.beta_s_per_byte, gamma_s_per_byte=link.gamma_s_per_byte,
        cores=os.cpu_count() or 1, measured_at=datetime.now(timezone.utc).isoformat(),
        efficiency=efficiency, shared_s_per_byte=link.shared_s_per_byte,
        native_alpha_s=link.native_alpha_s, staging_s_per_byte=link.staging_s_per_byte)
    path = calibration.save(cal, args.output)
    runtime = calibration.RuntimeBase(bytes=measure_runtime_bytes(), torch=torch.__version__,
                                      measured_at=cal.measured_at)
    runtime_path = calibration.save_runtime(runtime)  # the dry run's (calibrate.py)
    print(f"{args.nproc} processes: {cal.flops_per_s / 1e9:.1f} GFLOP/s fp32 per process, "
          f"training-step efficiency {efficiency:.2f}; "
          f"alpha {cal.alpha_s * 1e6:.1f} us, beta {cal.beta_s_per_byte * 1e9:.3f} ns/B, "
          f"gamma {cal.gamma_s_per_byte * 1e9:.3f} ns/B, shared "
          f"{cal.shared_s_per_byte * 1e9:.3f} ns/B; native alpha "
          f"{cal.native_alpha_s * 1e6:.1f} us, staging {cal.staging_s_per_byte * 1e9:.3f} ns/B "
          f"-> {path}; runtime base {runtime.bytes / 1e6:.0f} MB -> {runtime_path}")
    return 0
