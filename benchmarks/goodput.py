"""Goodput under injected failures: useful steps per minute of the same training job under
fault.mode=restart and fault.mode=replicas, measured in the same run (docs/faults.md,
docs/planner.md#goodput-under-failures for the planner's estimate).

Each mode runs `shardtrain train --nproc 4` (the default model unless --config says
otherwise) while this script kills one worker with SIGKILL, from outside, by its PID,
every --kill-every steps taken: it follows rank 0's metrics.jsonl for the steps and finds
the workers among the launcher's descendants (`victim`).
- restart: dp=4, a checkpoint every --checkpoint-every steps (25), torchrun's restarts
  (`--max-restarts`): every kill restarts the whole job, which resumes from its newest
  checkpoint and takes the steps since again. The victim is the last-started worker.
- replicas: R=2 groups of 2 (ZeRO-2 inside), `--fault.mode replicas --parallel.replicas 2`:
  a kill takes out group 1 (the victim is one of its ranks, SHARDTRAIN_REPLICA=1), group
  0 keeps stepping on its half of the batch, and group 1 rejoins from it.
With --kill-every at or below checkpoint.every, restart mode never gets past its first
checkpoint interval: each attempt is killed before it saves, until torchrun's restarts run
out (exit 1, the table's figure is then what the last attempt logged).
"Steps taken" counts every step a worker finished, redone ones too, so failures come at a
rate per unit of work, as they come per hour on a cluster. A useful step is one on the
full global batch: a step with `live` of R groups counts live / R (the record's `LIVE`
field; a record without it counts 1). Useful steps per minute = the final run's useful
steps / the wall time from launch to exit. Figures go to docs/faults.md with the command,
machine and date.

    python benchmarks/goodput.py                           # both modes, 200 steps, a kill every 40
    python benchmarks/goodput.py --modes restart --steps 60 --kill-every 30
    python benchmarks/goodput.py --modes restart --config tiny --micro-batch 2 --steps 40 \
        --kill-every 15 --checkpoint-every 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

LIVE = "quorum"  # the metrics record's live-group count (fault.mode=replicas)
MODES = {
    "restart": ["--fault.mode", "restart"],
    "replicas": ["--fault.mode", "replicas", "--parallel.replicas", "2", "--parallel.zero", "2"],
}


def children(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc: each of its tasks' children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def proc_text(pid: int, name: str) -> str:
    """/proc/PID/NAME with NULs as spaces (cmdline) or newlines (environ); "" once gone."""
    try:
        raw = Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return ""
    return raw.decode(errors="replace").replace("\0", "\n" if name == "environ" else " ")


def is_worker(pid: int, parent: int) -> bool:
    """A training worker: forked by the elastic agent's forkserver (launch.py), spawned, or
    exec'd by a launcher that gave it a LOCAL_RANK. The forkserver's children inherit its
    exec-time environment, so RANK is not readable from /proc there: ranks are told apart by
    start order (PID) instead."""
    return ("multiprocessing.forkserver" in proc_text(parent, "cmdline")
            or "spawn_main" in proc_text(pid, "cmdline")
            or "\nLOCAL_RANK=" in "\n" + proc_text(pid, "environ"))


def victim(launcher: int, mode: str) -> int | None:
    """The worker to kill, the last started: of group 1 under replicas (the subtree of the
    process its launcher started with SHARDTRAIN_REPLICA=1), else of the job."""
    workers, todo = [], [(launcher, 0, mode != "replicas")]
    while todo:
        pid, parent, inside = todo.pop()
        inside = inside or "\nSHARDTRAIN_REPLICA=1\n" in "\n" + proc_text(pid, "environ")
        if inside and parent and is_worker(pid, parent):
            workers.append(pid)
        todo += [(kid, pid, inside) for kid in children(pid)]
    workers = [pid for pid in workers if "resource_tracker" not in proc_text(pid, "cmdline")]
    return max(workers, default=None)


def records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    run_dir = Path(args.run_root) / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    kills = args.steps // args.kill_every + 2
    cmd = [sys.executable, "-m", "shardtrain", "train", "--config", args.config, "--nproc", "4",
           "--train.steps", str(args.steps), "--train.run_dir", str(run_dir),
           "--train.micro_batch", str(args.micro_batch),
           "--train.log_every", "1",  # rank 0 writes each step's record at once: kills land on time
           "--checkpoint.every", str(args.checkpoint_every if mode == "restart" else 0),
           "--max-restarts", str(kills), *MODES[mode], *args.overrides]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if args.quiet else None,
                            start_new_session=True)
    taken = last = killed = 0
    next_kill = args.kill_every
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if time.monotonic() - start > 60 * args.timeout_min:
                raise TimeoutError(f"{mode}: over {args.timeout_min} minutes")
            steps = [r["step"] for r in records(run_dir / "metrics.jsonl")]
            now = max(steps, default=0)
            taken += max(0, now - last)  # a resume rewrites the file back to its checkpoint
            last = now
            if taken >= next_kill and now < args.steps:
                pid = victim(proc.pid, mode)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                    print(f"[goodput] {mode}: killed pid {pid} after {taken} steps taken "
                          f"(step {now})", flush=True)
                next_kill += args.kill_every
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - start
    final = records(run_dir / "metrics.jsonl")
    useful = sum(r.get(LIVE, 2 if mode == "replicas" else 1) / (2 if mode == "replicas" else 1)
                 for r in final)
    return {"mode": mode, "exit": proc.returncode, "steps": len(final), "taken": taken,
            "kills": killed, "wall_s": wall, "useful_steps": useful,
            "useful_per_min": 60 * useful / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="default", help="preset or TOML (default: default)")
    p.add_argument("--steps", type=int, default=200, help="train.steps (default 200)")
    p.add_argument("--kill-every", type=int, default=40, help="steps taken between kills")
    p.add_argument("--micro-batch", type=int, default=4, help="train.micro_batch (default 4: "
                   "the default model's global batch of 16 over dp = 4)")
    p.add_argument("--checkpoint-every", type=int, default=25,
                   help="checkpoint.every under restart (default 25)")
    p.add_argument("--modes", default="restart,replicas", help="restart,replicas")
    p.add_argument("--run-root", default="runs/goodput")
    p.add_argument("--timeout-min", type=float, default=60.0, help="per mode")
    p.add_argument("--quiet", action="store_true", help="hide the runs' own output")
    p.add_argument("overrides", nargs="*", help="more --section.field VALUE for both runs "
                   "(after --)")
    args = p.parse_args(argv)
    if min(args.steps, args.kill_every, args.checkpoint_every, args.micro_batch) < 1:
        p.error("--steps, --kill-every, --checkpoint-every and --micro-batch must be >= 1")
    results = [run_mode(mode, args) for mode in args.modes.split(",")]
    print(f"\n{'mode':9} {'exit':>4} {'steps':>5} {'taken':>5} {'kills':>5} {'wall s':>8} "
          f"{'useful':>7} {'useful/min':>10}")
    for r in results:
        print(f"{r['mode']:9} {r['exit']:>4} {r['steps']:>5} {r['taken']:>5} {r['kills']:>5} "
              f"{r['wall_s']:>8.1f} {r['useful_steps']:>7.1f} {r['useful_per_min']:>10.2f}")
    done = {r["mode"]: r for r in results if r["exit"] == 0}
    if {"restart", "replicas"} <= done.keys():
        print(f"replicas / restart useful steps per minute: "
              f"{done['replicas']['useful_per_min'] / done['restart']['useful_per_min']:.2f}")
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
