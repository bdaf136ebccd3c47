"""The parameter-server study (seeds 000/001; docs/ps.md): the default model on N workers
under all-reduce data parallelism and a parameter server in sync, async and ssp(s=2) modes,
with and without one worker 1.5x slow; then the bytes one server receives per step
against the number of servers S and against a ring all-reduce (the incast of seed 001).

    python benchmarks/ps_study.py [--workers 4] [--steps 20] [--out runs/ps_study]
                                  [--figures docs/figures] [--section.field VALUE ...]

Each run is `shardtrain train` (the default preset, train.micro_batch 4 so that 4 workers
share the global batch of 16). Figures (PNG): loss against wall-clock time and against
steps (worker 0's metrics.jsonl: sync and dp log the mean over workers, async and ssp
worker 0's own loss), and server bytes per step. Table: throughput in sequences/s while
every worker runs (dp: global batch x steps / time; a parameter server: pushes x batch
share from the server's arrival times, up to the moment the first worker is done, so a
straggler's tail does not count), and the staleness the server measured. A figure, never
a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MODES = {"dp": [], "sync": ["--parallel.ps_servers", "1"],
         "async": ["--parallel.ps_servers", "1", "--parallel.ps_mode", "async"],
         "ssp2": ["--parallel.ps_servers", "1", "--parallel.ps_mode", "ssp",
                  "--parallel.ps_staleness", "2"]}
COMMON = ["--train.micro_batch", "4", "--train.eval_every", "0", "--train.sample_tokens", "0",
          "--train.progress", "false"]


def train(run_dir: Path, nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "shardtrain", "train", "--nproc", str(nproc),
           "--train.run_dir", str(run_dir), *COMMON, *args]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def read(run_dir: Path, workers: int, batch: int) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records]
    wall = [sum(times[:i + 1]) for i in range(len(times))]
    out = {"steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
           "wall": wall, "eval_loss": records[-1].get("eval_loss")}
    servers = sorted(run_dir.glob("ps_server*.json"))
    if not servers:  # all-reduce: every worker steps together
        out["throughput"] = batch * (len(times) - 1) / sum(times[1:])
        out["staleness"] = (0.0, 0)
        return out
    recs = json.loads(servers[0].read_text())["records"]
    last = {}
    for r in recs:
        last[r["worker"]] = max(last.get(r["worker"], 0.0), r["arrived"])
    start, end = min(r["arrived"] for r in recs), min(last.values())
    pushes = sum(1 for r in recs if start < r["arrived"] <= end)
    out["throughput"] = pushes * batch / workers / (end - start) if end > start else float("nan")
    st = [r["staleness"] for r in recs]
    out["staleness"] = (sum(st) / len(st), max(st))
    return out


def _mean_step(run_dir: Path) -> float:
    times = [json.loads(x)["step_time_s"] for x in
             (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return sum(times) / len(times)


def incast(out: Path, workers: int, overrides: list[str]) -> dict:
    """Server bytes received per step (from its ledger) for S = 1, 2, 4, and the ring."""
    rows = {}
    for s in (1, 2, 4):
        run = out / f"incast_s{s}"
        train(run, workers + s, ["--parallel.ps_servers", str(s), "--train.steps", "2",
                                 *overrides])
        got = [json.loads(p.read_text()) for p in sorted(run.glob("ps_server*.json"))]
        rows[s] = max(g["push_recv_bytes"] / g["steps"] for g in got)
    ring = out / "incast_ring"
    train(ring, workers, ["--train.steps", "2", *overrides])
    sent = [json.loads(x)["comm_bytes"] for x in (ring / "metrics.jsonl").read_text().splitlines()]
    return {"server_recv_bytes": rows, "ring_bytes_per_rank": max(sent)}


def plot(results: dict, bytes_: dict, figures: Path, workers: int) -> list[Path]:
    figures.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey=True)
    for col, slow in enumerate((False, True)):
        for mode in MODES:
            r = results[(mode, slow)]
            axes[0][col].plot(r["wall"], r["loss"], label=mode)
            axes[1][col].plot(r["steps"], r["loss"], label=mode)
        title = "one worker 1.5x slow" if slow else "no straggler"
        axes[0][col].set(title=f"{title}: loss vs wall-clock", xlabel="seconds (worker 0)")
        axes[1][col].set(title=f"{title}: loss vs steps", xlabel="step (worker 0)")
        for ax in axes[:, col]:
            ax.set_ylabel("training loss")
            ax.legend()
    fig.tight_layout()
    loss_png = figures / "ps_loss.png"
    fig.savefig(loss_png, dpi=90)
    fig, ax = plt.subplots(figsize=(6, 4))
    s = list(bytes_["server_recv_bytes"])
    ax.bar([str(x) for x in s], [bytes_["server_recv_bytes"][x] / 2**20 for x in s],
           label="bytes one server receives per step")
    ax.axhline(bytes_["ring_bytes_per_rank"] / 2**20, color="k", ls="--",
               label="ring all-reduce: bytes per rank per step")
    ax.set(xlabel=f"servers S ({workers} workers)", ylabel="MiB per step",
           title="incast: N x model / S at each server")
    ax.legend()
    fig.tight_layout()
    incast_png = figures / "ps_incast.png"
    fig.savefig(incast_png, dpi=90)
    return [loss_png, incast_png]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/ps_study")
    parser.add_argument("--figures", default="docs/figures")
    args, overrides = parser.parse_known_args()
    out, n, batch = Path(args.out), args.workers, 16
    began = time.time()
    results = {}
    for slow in (False, True):
        for mode, extra in MODES.items():
            run = out / f"{mode}{'_slow' if slow else ''}"
            nproc = n + (1 if extra else 0)
            straggler = ["--train.slow_ranks", "1:1.5"] if slow else []
            train(run, nproc, [*extra, *straggler, "--train.steps", str(args.steps), *overrides])
            results[(mode, slow)] = read(run, n, batch)
    # Scheduling: the straggler run once more without priority (FIFO pushes and pulls).
    fifo = out / "sync_none_slow"
    train(fifo, n + 1, [*MODES["sync"], "--parallel.ps_priority", "none",
                        "--train.slow_ranks", "1:1.5", "--train.steps", str(args.steps), *overrides])
    step_s = {name: _mean_step(out / name) for name in ("sync_slow", "sync_none_slow")}
    bytes_ = incast(out, n, overrides)
    figures = plot(results, bytes_, Path(args.figures), n)
    print(f"\n{'mode':>6} {'straggler':>9} {'seq/s':>7} {'final loss':>10} {'eval loss':>9} "
          f"{'staleness mean/max':>19}")
    table = []
    for (mode, slow), r in results.items():
        mean, top = r["staleness"]
        print(f"{mode:>6} {'1.5x' if slow else '-':>9} {r['throughput']:7.2f} "
              f"{r['loss'][-1]:10.4f} {r['eval_loss']:9.4f} {mean:12.2f} / {top}")
        table.append({"mode": mode, "slow": slow, "throughput": r["throughput"],
                      "final_loss": r["loss"][-1], "eval_loss": r["eval_loss"],
                      "staleness_mean": mean, "staleness_max": top})
    print(f"\nsync, one worker 1.5x slow, mean step time (worker 0, after step 1): "
          f"priority=layer {step_s['sync_slow']:.3f} s, priority=none "
          f"{step_s['sync_none_slow']:.3f} s")
    print("bytes one server receives per step:",
          {s: int(b) for s, b in bytes_["server_recv_bytes"].items()},
          "ring all-reduce bytes per rank per step:", bytes_["ring_bytes_per_rank"])
    print(json.dumps({"machine": platform.platform(), "cpus": __import__("os").cpu_count(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "seconds": round(time.time() - began), "workers": n,
                      "steps": args.steps, "table": table, "incast": bytes_, "priority_step_s": step_s,
                      "figures": [str(f) for f in figures]}))


if __name__ == "__main__":
    main()
