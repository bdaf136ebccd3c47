"""Process launch: local multi-process runs through torch's elastic launcher, and the
per-process set-up shared with `torchrun`.

`shardtrain train --nproc N` starts N workers on this machine exactly as
`torchrun --standalone --nproc-per-node N` would; under torchrun (one node or many) the
launcher has already started us, and each process goes straight to `run_worker`.
The launcher's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE variables are read here,
once, and passed on explicitly.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.comm.p2p import CommTimeout
from shardtrain.comm.watchdog import NCCL_GRACE_S, Watchdog
from shardtrain.data.workers import hidden_main
from shardtrain.train.start.device import check_device, gpu_ordinal


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    # Started by an elastic agent (torchrun, or --nproc: launch_local): the node's workers
    # share the agent's environment, so they all see the same GPUs.
    agent: bool = False

    @staticmethod
    def from_env() -> "ProcessInfo":
        env = os.environ
        return ProcessInfo(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                           local_rank=int(env.get("LOCAL_RANK", 0)),
                           local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                           agent="TORCHELASTIC_RUN_ID" in env)


def under_launcher() -> bool:
    """True inside a process started by torchrun or our own launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def pick_device(kind: str, info: ProcessInfo) -> torch.device:
    """This process's device: its GPU on CUDA (train/start/device.py `gpu_ordinal`; one GPU
    per rank: NCCL cannot put two ranks of a group on one GPU), else the CPU."""
    from shardtrain.config import ConfigError

    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use "
                              "--train.device cpu")
        torch.cuda.set_device(gpu_ordinal(info.local_rank, info.local_world_size,
                                          torch.cuda.device_count(), shared=info.agent))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(info: ProcessInfo, device: torch.device, timeout_s: float) -> None:
    """Join the process group (NCCL on CUDA, Gloo on CPU) when there is more than one rank,
    and share the CPU cores fairly among the local processes."""
    # On GPUs too: their host work (ZeRO-Offload's Adam, a parameter server, the data) would
    # otherwise run ranks x cores threads. torchrun sets OMP_NUM_THREADS=1 for this; torch's
    # elastic API, which --nproc uses, sets nothing. The cores this process may run on: a
    # scheduler's CPU binding (Slurm's cgroups) leaves fewer than the machine has.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // info.local_world_size))
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = _attempt_store(info, timeout_s)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None,
                                store=store, rank=info.rank if store else -1,
                                world_size=info.world_size if store else -1)


def _attempt_store(info: ProcessInfo, timeout_s: float) -> dist.Store | None:
    """A restarted job's rendezvous store, its keys under the attempt's own prefix; None
    (the launcher's env:// store) on the first attempt. The launcher's store outlives a
    failed attempt, and the dead processes' keys (every group's Gloo addresses) would
    otherwise be read by the new ones, which then connect to ports no one listens on."""
    from shardtrain.train.guard import restart_count

    restarts = restart_count()
    if not restarts:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          info.world_size, is_master=not agent and info.rank == 0,
                          timeout=timedelta(seconds=timeout_s), multi_tenant=not agent)
    return dist.PrefixStore(f"shardtrain/attempt_{restarts}", store)


def launch_local(nproc: int, entrypoint, *args, max_restarts: int = 0,
                 shutdown_timeout_s: float = 30.0) -> dict[int, object]:
    """Run `entrypoint(*args)` in `nproc` local processes (a module-level function: it is
    pickled); return each rank's return value. When a worker fails, the launcher stops the
    others and starts them all again, up to `max_restarts` times (workers resume from the
    newest checkpoint: `run_worker`); after that a failing worker raises ChildFailedError.
    A SIGINT or SIGTERM to this process is passed on to the workers, which are given
    `shutdown_timeout_s` to save and stop (train/checkpoint/interrupt.py), then it raises torch's
    SignalException."""
    import dataclasses
    import multiprocessing

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers fork from a server that imported torch and the trainer once (a spawned
    # worker imports them itself: seconds each, on every start and restart), yet start
    # clean: nothing but imports ran in the server, no thread, no CUDA. torch._dynamo too:
    # every torch optimizer's constructor imports it (1.3-2 s), compiling or not.
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "shardtrain.train.trainer"])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"shardtrain-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="forkserver")
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # torch >= 2.12
        config.shutdown_timeout = max(1, int(shutdown_timeout_s))
    _quiet_signal_warnings()
    # A forkserver child re-runs the entry script as spawn does: a console script without a
    # __main__ guard ran the CLI again in every rank (data/workers.py). An entrypoint the
    # script defines itself needs that re-run to be found (and the script has a guard, or
    # it would launch itself again), so then __main__ stays.
    own = getattr(entrypoint, "__module__", None) == "__main__"
    with contextlib.nullcontext() if own else hidden_main():
        return elastic_launch(config, entrypoint)(*args)


class _SignalNotice(logging.Filter):
    """Drops the elastic agent's warnings that it got a signal and passes it on, and its
    traceback for a worker that exited on purpose (a signal after saving, 130 / 143; a
    failed checkpoint save, 74): the workers' rank 0 prints the one line that matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        from shardtrain.train.checkpoint.agree import EXIT_CODE
        from shardtrain.train.checkpoint.interrupt import EXIT_CODES

        msg = str(record.msg)
        if msg.startswith("failed (exitcode") and record.args and \
                record.args[0] in {*EXIT_CODES, EXIT_CODE}:
            return False
        return not any(text in msg for text in
                       ("death signal", "via signal", "termination signal"))


def _quiet_signal_warnings() -> None:
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _SignalNotice) for f in logger.filters):
            logger.addFilter(_SignalNotice())


def start_watchdog(mesh, cfg, info: ProcessInfo):
    """The hang watchdog over this process's flight recorder, talking to its peers through
    torch.distributed's store (comm/watchdog.py); None on one process."""
    if info.world_size == 1:
        return None
    from shardtrain.train.guard import restart_count

    store = dist.distributed_c10d._get_default_store()
    attempt = restart_count()
    return Watchdog(mesh.ledger.flight, store, rank=info.rank, world_size=info.world_size,
                    timeout_s=cfg.comm.timeout_s, run_dir=cfg.train.run_dir,
                    interval=min(1.0, cfg.comm.timeout_s / 4), attempt=attempt).start()


def run_worker(config_text: str) -> dict:
    """One training process: join the group, build the mesh, train, leave. `config_text` is
    the resolved config as TOML (it travels to workers by value, not through files or env)."""
    from shardtrain import config as config_mod
    from shardtrain.config.replicas import total_world
    from shardtrain.train.checkpoint.agree import EXIT_CODE as SAVE_FAILED_EXIT
    from shardtrain.train.checkpoint.checkpoint import resume_after_restart
    from shardtrain.train.checkpoint.interrupt import exit_code
    from shardtrain.train.guard import restart_count

    cfg = config_mod.loads(config_text)
    restarts = restart_count()
    info = ProcessInfo.from_env()
    if cfg.fault.mode == "restart":  # a restarted job picks up its last checkpoint
        cfg = resume_after_restart(cfg, restarts)
        if restarts and info.rank == 0:
            print(f"restart {restarts}: resuming from {cfg.checkpoint.resume or 'the start'}",
                  flush=True)
    elif restarts and info.rank == 0:  # fault.mode=replicas: from a live group's state
        print(f"restart {restarts}: rejoining the live replica groups", flush=True)
    cfg.validate(total_world(cfg, info.world_size))  # under replicas: every group's ranks
    device = pick_device(cfg.train.device, info)
    check_device(cfg, device)
    # NCCL's own timeout is a backstop behind the hang watchdog's (comm/watchdog.py).
    group_timeout = cfg.comm.timeout_s + (NCCL_GRACE_S if device.type == "cuda" else 0.0)
    init_distributed(info, device, group_timeout)
    outcome = _train(cfg, info, device, group_timeout)  # a failure propagates: no leave()
    leave()
    if "server" in outcome:
        return outcome
    if "exit_code" in outcome:  # a failed save, said by rank 0 (train/checkpoint/agree.py)
        if under_launcher():
            sys.exit(SAVE_FAILED_EXIT)
        return outcome
    result, signum = outcome["result"], outcome["signum"]
    if result.interrupted is not None:
        if info.rank == 0:
            print(result.interrupted, flush=True)
        if under_launcher():  # exit now: a launcher that was signalled too reads no result
            sys.exit(exit_code(signum))
        return {"losses": result.losses, "interrupted": signum}
    if info.rank == 0:
        last = result.history[-1] if result.history else {}
        print(f"done: step {last.get('step', 0)}  loss {last.get('loss', float('nan')):.4f}  "
              f"eval_loss {result.eval_loss if result.eval_loss is not None else float('nan'):.4f}"
              f"  run dir {cfg.train.run_dir}", flush=True)
        if result.sample is not None:
            print("--- sample ---\n" + result.sample + "\n--------------", flush=True)
    return {"losses": result.losses, "eval_loss": result.eval_loss}


def _train(cfg, info: ProcessInfo, device: torch.device, group_timeout: float) -> dict:
    """Build the mesh and train (or serve, on a parameter server's rank); plain values out.
    Everything that holds a process group (the mesh, its communicators, the watchdog, the
    trainer) lives in this frame only, so it is freed when the frame returns, before
    run_worker leaves the group (`leave`)."""
    from shardtrain.comm import build_mesh
    from shardtrain.mesh import shape_for
    from shardtrain.train.checkpoint.agree import EXIT_CODE as SAVE_FAILED_EXIT, SaveFailed
    from shardtrain.train.checkpoint.interrupt import Interrupt
    from shardtrain.train.trainer import Trainer

    p = cfg.parallel
    shape = shape_for(cfg, info.world_size)
    node_size = p.node_size or info.local_world_size
    if p.ps_servers:  # the servers take the last ranks: the workers' nodes may be uneven,
        node_size = math.gcd(node_size, shape.world_size)  # so count conservatively
    mesh = build_mesh(shape, rank=info.rank, node_size=node_size,
                      algorithm=cfg.comm.algorithm, timeout_s=cfg.comm.timeout_s, device=device,
                      group_timeout_s=group_timeout)
    watchdog = start_watchdog(mesh, cfg, info)
    try:
        if not mesh.member:  # a parameter server's rank (parallel/ps/, train/ps_server.py)
            from shardtrain.train.ps_server import run_server

            return {"server": run_server(cfg, mesh)}
        # SIGINT/SIGTERM: save, then stop; under fault.mode=replicas: stop at once (a
        # rank blocked in a quorum would keep its group alive in the lighthouse's eyes).
        with Interrupt(info.world_size, catch=cfg.fault.mode == "restart") as interrupt:
            result = Trainer(cfg, mesh, device).run(interrupt)
        return {"result": result, "signum": interrupt.signum}
    except CommTimeout as e:
        if watchdog is None:
            raise
        watchdog.abort(str(e).splitlines()[0])  # every rank exits, naming who hung
    except SaveFailed as e:  # every rank stopped at the same save (train/checkpoint/agree.py)
        if info.rank == 0:
            print(f"shardtrain train: error: {e}", file=sys.stderr, flush=True)
        return {"exit_code": SAVE_FAILED_EXIT}
    finally:
        if watchdog is not None:
            watchdog.stop()


def leave() -> None:
    """Leave the process group in the order that cannot deadlock (benchmarks/teardown.py
    says why; the benchmarks keep their own copy, as they also measure other trees): what
    held a group is already out of scope and freed here (collect: reference cycles too),
    then a barrier (every rank's collectives done, waited for with the GIL released), then
    destroy_process_group, whose destructors find the groups' threads idle. Only after a
    clean return: a failure propagates without a barrier its peers may never reach."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
