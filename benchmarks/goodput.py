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
  a kill takes out group 1 (the victim is one of its workers: the processes below the
  forkserver its launcher started with SHARDTRAIN_REPLICA=1, launch_replicas.py), group 0
  keeps stepping on its half of the batch, and group 1's own launcher restarts it and it
  rejoins from group 0. Steps are followed in group 0's run dir, <run_dir>/replica_0.
With --kill-every at or below checkpoint.every, restart mode never gets past its first
checkpoint interval: each attempt is killed before it saves, until torchrun's restarts run
out (exit 1, the table's figure is then what the last attempt logged). Above it, each
attempt saves at least once before it is killed, and only the steps since its last save
(fewer than checkpoint.every) are taken again.
"Steps taken" counts every step record the followed rank 0 wrote, redone and uncommitted
ones too, so failures come at a rate per unit of work, as they come per hour on a cluster.
A useful step is a sample of the global batch trained on, in steps: an applied step
(`committed` not false) with `replicas_live` = L of R groups counts L / R (the samples it
trained on; the lost group's share is read by the next step, docs/faults.md), a record
without the field (restart) counts 1, an uncommitted one 0. Useful steps per minute = the
final run's useful steps / the wall time from launch to exit; "after start" divides by the
wall time from the first step's record instead (the planner counts no start-up).
After both modes the script prints the planner's estimate (plan/goodput.py) for the same
settings, its inputs measured in this run: the step time T (the mean gap between two
records), the save's extra time, each mode's recovery (kill to the first step after the
restart; replicas: kill to group 0's step that sent group 1 its state), and the kill
interval as an MTBF: a kill every N steps taken on a job of 4 processes is a job failure
rate of 1 / (N T), i.e. mtbf_hours = 4 N T / 3600 per process.

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
from statistics import fmean, median

from shardtrain.launch_replicas import group_dir
from shardtrain.plan.goodput import replicas_goodput, restart_goodput

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
    """The worker to kill, the last started: of group 1 under replicas, else of the job.
    A group's launcher process sets SHARDTRAIN_REPLICA in os.environ after it started, which
    /proc/PID/environ does not show; the forkserver it then starts (an exec) has it, and so
    do the workers forked from that server (launch_replicas.py, launch.py)."""
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


def useful(record: dict, replicas: int) -> float:
    """The samples a step record trained on, in global batches (module docstring)."""
    if record.get("committed") is False:
        return 0.0
    return record.get("replicas_live", replicas) / replicas


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    run_dir = Path(args.run_root) / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    replicas = 2 if mode == "replicas" else 1
    follow = (group_dir(run_dir, 0) if replicas > 1 else run_dir) / "metrics.jsonl"
    kills = args.steps // args.kill_every + 2
    cmd = [sys.executable, "-m", "shardtrain", "train", "--config", args.config, "--nproc", "4",
           "--train.steps", str(args.steps), "--train.run_dir", str(run_dir),
           "--train.micro_batch", str(args.micro_batch),
           "--train.log_every", "1",  # rank 0 writes each step's record at once: kills land on time
           "--train.progress", "false",
           "--checkpoint.every", str(args.checkpoint_every if mode == "restart" else 0),
           "--max-restarts", str(kills), *MODES[mode], *args.overrides]
    print(f"[goodput] {mode}: start, load average {os.getloadavg()}", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if args.quiet else None,
                            start_new_session=True)
    seen = []  # (record, the time this script first read it), in the order written
    taken = count = killed_at = 0
    kill_times, recovery = [], []  # each kill's time; kill to recovered (module docstring)
    next_kill = args.kill_every
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            if now - start > 60 * args.timeout_min:
                raise TimeoutError(f"{mode}: over {args.timeout_min} minutes")
            recs = records(follow)
            count = min(count, len(recs))  # a resume cut the file back to its checkpoint
            for rec in recs[count:]:
                seen.append((rec, now))
                # Recovered: group 1 back (replicas: group 0 sent it its state, or saw it
                # rejoin after stepping alone), the restarted job's first step (restart).
                back = rec.get("sent_bytes") or rec.get("rejoined") if replicas > 1 \
                    else rec["step"] <= killed_at
                if len(recovery) < len(kill_times) and back:
                    recovery.append(now - kill_times[-1])
            taken += len(recs) - count
            count = len(recs)
            step = recs[-1]["step"] if recs else 0
            if taken >= next_kill and step < args.steps:
                pid = victim(proc.pid, mode)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kill_times.append(time.monotonic())
                    killed_at = step
                    print(f"[goodput] {mode}: killed pid {pid} after {taken} steps taken "
                          f"(step {step})", flush=True)
                next_kill += args.kill_every
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - start
    done = sum(useful(r, replicas) for r in records(follow))
    return {"mode": mode, "exit": proc.returncode, "steps": count, "taken": taken,
            "kills": len(kill_times), "wall_s": wall, "useful_steps": done,
            "useful_per_min": 60 * done / wall, "first_s": seen[0][1] - start if seen else 0,
            "recovery_s": recovery, **step_times(seen, replicas, args.checkpoint_every)}


def step_times(seen: list[tuple[dict, float]], replicas: int, every: int) -> dict:
    """From the times records appeared: T, the mean gap between two consecutive steps of
    every group (each gap holds a step and everything between two steps; a mean, as a
    flush may write several records at once); under restart the save's extra time, the
    mean gap after a checkpoint's step less T; under replicas the mean gap of the steps
    group 0 took alone (on this machine, faster than T: its 2
    processes have the cores to themselves; on a cluster each has its own device)."""
    gaps: dict[str, list[float]] = {"full": [], "save": [], "alone": []}
    for (a, ta), (b, tb) in zip(seen, seen[1:]):
        if b["step"] != a["step"] + 1 or b.get("committed") is False:
            continue
        live = b.get("replicas_live", replicas)
        kind = "alone" if live < replicas else "save" if a["step"] % every == 0 and \
            replicas == 1 else "full"
        gaps[kind].append(tb - ta)
    step_s = fmean(gaps["full"]) if gaps["full"] else float("nan")
    return {"step_s": step_s,
            "save_s": max(0.0, fmean(gaps["save"]) - step_s) if gaps["save"] else 0.0,
            "alone_s": fmean(gaps["alone"]) if gaps["alone"] else None}


def planner_estimate(r: dict, args: argparse.Namespace) -> float:
    """The planner's useful steps per minute (plan/goodput.py) for run `r`'s measured step
    time, save and recovery, at its kill interval as an MTBF (module docstring)."""
    step_s = r["step_s"]
    mtbf_hours = 4 * args.kill_every * step_s / 3600
    back = max(0.0, median(r["recovery_s"]) - step_s) if r["recovery_s"] else 0.0
    common = {"step_s": step_s, "processes": 4, "mtbf_hours": mtbf_hours, "restart_s": back}
    if r["mode"] == "restart":  # the measured recovery holds the restart and the load
        g = restart_goodput(**common, load_s=0.0, save_s=r["save_s"],
                            checkpoint_every=args.checkpoint_every)
    else:  # and the restart and the transfer
        g = replicas_goodput(**common, transfer_s=0.0, replicas=2)
    return g.useful_steps_per_hour / 60


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
    print(f"\n{'mode':9} {'exit':>4} {'steps':>5} {'taken':>5} {'kills':>5} {'wall s':>7} "
          f"{'useful':>7} {'useful/min':>10} {'after start':>11} {'planner/min':>11} {'T s':>6} "
          f"{'save s':>6} {'alone s':>7} {'start s':>7}  recovery s")
    for r in results:
        alone = "-" if r["alone_s"] is None else f"{r['alone_s']:.3f}"
        print(f"{r['mode']:9} {r['exit']:>4} {r['steps']:>5} {r['taken']:>5} {r['kills']:>5} "
              f"{r['wall_s']:>7.1f} {r['useful_steps']:>7.1f} {r['useful_per_min']:>10.2f} "
              f"{60 * r['useful_steps'] / (r['wall_s'] - r['first_s']):>11.2f} "
              f"{planner_estimate(r, args):>11.2f} {r['step_s']:>6.3f} {r['save_s']:>6.2f} "
              f"{alone:>7} {r['first_s']:>7.1f}  "
              f"{' '.join(f'{x:.1f}' for x in r['recovery_s'])}")
    done = {r["mode"]: r for r in results if r["exit"] == 0}
    if {"restart", "replicas"} <= done.keys():
        ratio = done["replicas"]["useful_per_min"] / done["restart"]["useful_per_min"]
        plan = [planner_estimate(done[m], args) for m in ("replicas", "restart")]
        print(f"replicas / restart useful steps per minute: {ratio:.2f} (planner "
              f"{plan[0] / plan[1] if plan[1] else float('inf'):.2f})")
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
