"""`shardtrain train --nproc N` under fault.mode = replicas, on one machine: a torchft
lighthouse (unless fault.lighthouse names one) and parallel.replicas = R groups of N / R
processes, each group its own elastic launch (its own rendezvous store and port, its own
`--max-restarts`), so a failed process stops and restarts its group only; the other groups
keep stepping with a smaller quorum (parallel/replica/torchft_group.py, docs/faults.md).

The contract a group's processes see (the same under torchrun, one torchrun per group):
SHARDTRAIN_REPLICA = the group's index, TORCHFT_LIGHTHOUSE = the lighthouse's address,
RANK / WORLD_SIZE = the process's rank in its group and the group's size. Per group the
config differs only where the fingerprint allows (torchft_group.py): the run dir, which
is <train.run_dir>/replica_<r>, and train.inject_kill, whose RANK counts over all groups
(group r's local rank k is r * N / R + k) and reaches only the group holding that rank.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import sys
from pathlib import Path

from shardtrain import config as config_mod
from shardtrain.config import Config, ConfigError
from shardtrain.config.faults import parse_injection
from shardtrain.config.replicas import LIGHTHOUSE_ENV, REPLICA_ENV

# The lighthouse started here: a group that stopped heartbeating for 2 s is out of the
# quorum, and a quorum waits at most 1 s for a heartbeating group that has not asked to
# join (a group still starting or restarting joins a later step's quorum instead).
HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS = 2000, 1000
# A group whose process died is torn down by its agent within this many seconds. Short on
# purpose: a surviving rank of the group (blocked in a collective or a quorum) keeps its
# group's torchft manager heartbeating until it is gone, and the lighthouse holds the other
# groups' quorum for a heartbeating group (torchft's split-brain rule: a quorum needs more
# than half of the heartbeating groups). Nothing is saved: the group rejoins from a peer.
GROUP_SHUTDOWN_S = 3.0


def group_dir(run_dir: str | Path, replica: int) -> Path:
    """Where group `replica` writes its metrics and checkpoints."""
    return Path(run_dir) / f"replica_{replica}"


def group_config(cfg: Config, replica: int, nproc: int) -> Config:
    """Group `replica`'s config: its run dir, and train.inject_kill in its own ranks."""
    per_group = nproc // cfg.parallel.replicas
    out = copy.deepcopy(cfg)
    out.train.run_dir = str(group_dir(cfg.train.run_dir, replica))
    kill = parse_injection("inject_kill", cfg.train.inject_kill)
    out.train.inject_kill = ""
    if kill is not None and kill.rank // per_group == replica:
        out.train.inject_kill = f"{kill.rank % per_group}:{kill.step}"
    return out


def check_groups(cfg: Config, nproc: int) -> None:
    r = cfg.parallel.replicas
    if nproc % r:
        raise ConfigError(f"--nproc {nproc} must be a multiple of parallel.replicas={r} (each "
                          "replica group runs --nproc / replicas processes)")


def launch_groups(cfg: Config, nproc: int, *, max_restarts: int) -> int:
    """Start the lighthouse and the groups, wait for every group; the first nonzero exit
    status of a group (after its own restarts), else 0."""
    from shardtrain.train.start.prepare import prepare_run

    check_groups(cfg, nproc)
    configs = [group_config(cfg, r, nproc) for r in range(cfg.parallel.replicas)]
    for r, group in enumerate(configs):  # checked against all N processes; each run dir
        prepare_run(group, nproc, prepare_data=r == 0, local_ranks=nproc)  # claimed
    # torchft's servers log every quorum and commit at INFO, several lines per step: warnings
    # only, unless the user's RUST_LOG says otherwise (the groups inherit it).
    os.environ.setdefault("RUST_LOG", "warn")
    lighthouse, address = None, cfg.fault.lighthouse
    if not address:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.fault.min_replicas,
                                      join_timeout_ms=JOIN_TIMEOUT_MS,
                                      heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        address = lighthouse.address()
    # spawn: this process may hold threads (the lighthouse's) that a fork would copy.
    ctx = multiprocessing.get_context("spawn")
    groups = []
    from shardtrain.data.workers import hidden_main

    try:
        for r, group in enumerate(configs):
            text = config_mod.to_toml(group)
            proc = ctx.Process(target=_group_main, name=f"replica-{r}",
                               args=(r, address, nproc // cfg.parallel.replicas, text,
                                     max_restarts))
            with hidden_main():  # the child must not run the entry script again
                proc.start()
            groups.append(proc)
        for proc in groups:
            proc.join()
    finally:
        for proc in groups:  # a signal or an error here: no group outlives the launcher
            if proc.is_alive():
                proc.terminate()
                proc.join()
        if lighthouse is not None:
            lighthouse.shutdown()
    return next((p.exitcode for p in groups if p.exitcode), 0)


def _group_main(replica: int, lighthouse: str, nproc: int, config_text: str,
                max_restarts: int) -> None:
    """One group's launcher process: its elastic agent and workers (launch.launch_local)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardtrain.launch import launch_local, run_worker

    os.environ[REPLICA_ENV], os.environ[LIGHTHOUSE_ENV] = str(replica), lighthouse
    try:
        launch_local(nproc, run_worker, config_text, max_restarts=max_restarts,
                     shutdown_timeout_s=GROUP_SHUTDOWN_S)
    except ChildFailedError as e:
        print(f"shardtrain train: replica group {replica} failed:\n{e}", file=sys.stderr)
        sys.exit(1)
