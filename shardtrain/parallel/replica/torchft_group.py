"""CrossReplica on torchft (fault.mode = replicas; docs/faults.md, "Replica groups on
torchft"): every replica group is its own torch.distributed world, and each of its ranks
reduces, through torchft's Manager, with the same-rank processes of the other live groups.

What torchft provides: the lighthouse (which groups are alive: heartbeats), the per-step
quorum, the reconfigurable cross-group process group (rebuilt on the quorum's store when
the membership changes), the commit protocol (should_commit: a step is applied only if no
rank of the group saw an error), and the state transfer to a group that is behind (HTTP,
rank to same rank, from a live peer). What this module adds: the group's own store for
torchft (fresh per launch attempt), the address its servers advertise (fault.advertise:
torchft's own is the host's name), the ledger records, the live groups and this group's
position among them, the step's events, and the refusal of a group whose config differs.

The launcher's contract (launch_replicas.py): SHARDTRAIN_REPLICA = this group's index
0..R-1; TORCHFT_LIGHTHOUSE = the lighthouse's address unless fault.lighthouse gives one.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardtrain.comm.ledger import add_record
from shardtrain.config import ConfigError
from shardtrain.config.replicas import LIGHTHOUSE_ENV, REPLICA_ENV

_STORE_KEY = "shardtrain/torchft_store"  # where group rank 0 publishes torchft's store port

# The config a rejoining group must share with the quorum: everything that shapes the
# model, its state or the step's numerics. Left out on purpose: run dirs, logging, test
# hooks (one group's train.inject_kill), timeouts, the lighthouse's address.
_AGREE_SECTIONS = ("model", "data", "parallel", "optim", "loss_scale", "lora")
_AGREE_TRAIN = ("steps", "global_batch", "micro_batch", "seq_len", "seed", "precision",
                "grad_reduce_dtype", "lr", "activation_checkpointing")


def fingerprint(cfg: Any) -> dict[str, str]:
    """{"section.field": repr(value)} of the fields every group must agree on."""
    out = {f"train.{k}": repr(getattr(cfg.train, k)) for k in _AGREE_TRAIN}
    for section in _AGREE_SECTIONS:
        for k, v in dataclasses.asdict(getattr(cfg, section)).items():
            out[f"{section}.{k}"] = repr(v)
    return out


def check_same_config(mine: dict[str, str], quorum: dict[str, str]) -> None:
    """One line naming the first differing field, or nothing."""
    for key in sorted(mine.keys() | quorum.keys()):
        if mine.get(key) != quorum.get(key):
            raise ConfigError(f"this replica group cannot rejoin: {key} = {mine.get(key)} here "
                              f"but {quorum.get(key)} in the live quorum; start it with the "
                              "quorum's config")


def replica_from_env(cfg: Any) -> int:
    """This group's index from the launcher's SHARDTRAIN_REPLICA (one torchrun per group)."""
    text = os.environ.get(REPLICA_ENV, "")
    if not text.isdigit() or int(text) >= cfg.parallel.replicas:
        raise ConfigError(f"fault.mode=replicas under torchrun: set {REPLICA_ENV} to this "
                          f"group's index, 0..{cfg.parallel.replicas - 1} (it is {text!r})")
    return int(text)


def _members(base: type) -> type:
    """torchft's reconfigurable process group `base`, remembering the global ranks of each
    quorum it is configured for (torchft numbers them group * group_world + group_rank)."""

    class Members(base):
        global_ranks: list[int] = []

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):
            self.global_ranks = list(global_ranks or [])
            super().configure(store_addr, replica_id, rank, world_size, quorum_id,
                              group_rank, group_world_size, global_ranks)

    return Members


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (its default: whole state, unchunked), telling a
    rejoining group's rank to fetch from `host` rather than from this host's name, which
    torchft's own builds its address from."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Advertised(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return Advertised(timeout=timeout, num_chunks=0)


def _state_bytes(obj: Any) -> int:
    """Bytes of the tensors inside a nested state dict (what the transfer moves)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


class TorchftReplicas:
    """CrossReplica over one torchft Manager per process (group rank = this rank of the
    group's mesh, group world = the mesh's world)."""

    shared_checkpoint = False  # each group saves into its own run directory

    def __init__(self, cfg: Any, mesh: Any, *, replica: int | None = None,
                 lighthouse: str | None = None):
        import torchft

        self.replica = replica_from_env(cfg) if replica is None else replica
        self.replicas = cfg.parallel.replicas
        lighthouse = lighthouse or cfg.fault.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ConfigError("fault.mode=replicas needs torchft's lighthouse: set "
                              f"fault.lighthouse or {LIGHTHOUSE_ENV} (shardtrain train --nproc "
                              "starts one)")
        self._mesh, self._fingerprint = mesh, fingerprint(cfg)
        self._quorum_timeout_s = cfg.fault.quorum_timeout_s
        timeout = timedelta(seconds=cfg.comm.timeout_s)
        cuda = mesh.device.type == "cuda"
        self._pg = _members(torchft.ProcessGroupNCCL if cuda else torchft.ProcessGroupGloo)(
            timeout=timeout)
        # The address the other groups reach this group's servers at (fault.advertise).
        advertise = cfg.fault.advertise or socket.gethostname()
        # The store is held: its server lives with the object.
        self._store, (host, port) = self._group_store(mesh, timeout, advertise)
        # The replica id's trailing digits are the group: torchft numbers the cross-group
        # ranks from them (group x group world + group rank), which `_groups` reads back.
        self._manager = torchft.Manager(
            pg=self._pg, load_state_dict=None, state_dict=None,
            min_replica_size=cfg.fault.min_replicas, use_async_quorum=False,
            # Groups built from one seed start equal (the parity tests): no transfer at step 0.
            init_sync=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.fault.quorum_timeout_s),
            rank=mesh.rank, world_size=mesh.world_size, store_addr=host, store_port=port,
            lighthouse_addr=lighthouse, replica_id=f"shardtrain_{self.replica:04d}",
            hostname=advertise, checkpoint_transport=_transport(advertise, timeout))
        self._groups: list[int] = []  # the live groups of the current quorum, ascending
        self._seen: list[int] = []  # ... of the previous step's
        self._events: dict[str, Any] = {}

    @staticmethod
    def _group_store(mesh: Any, timeout: timedelta, host: str
                     ) -> tuple[dist.TCPStore | None, tuple[str, int]]:
        """A store for torchft's Manager, made by group rank 0 on a free port and reached at
        `host` (rank 0's advertised address: a quorum's process group meets on one group's
        store, so the other groups connect to it too). Not the launcher's: that one outlives
        a failed attempt, and a restarted rank would read the dead manager's address from
        it. Its address reaches the group's other ranks through this attempt's own store
        (launch.py `_attempt_store`)."""
        store = None
        if mesh.rank == 0:
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                  timeout=timeout, multi_tenant=True)
        if mesh.world_size > 1:
            default = dist.distributed_c10d._get_default_store()
            if store is not None:
                default.set(_STORE_KEY, f"{host}:{store.port}")
            host, port = default.get(_STORE_KEY).decode().rsplit(":", 1)
            return store, (host, int(port))
        return store, (host, store.port)

    # ------------------------------------------------------------------ CrossReplica

    @property
    def live(self) -> int:
        return self._manager.num_participants()

    @property
    def position(self) -> int:
        return self._groups.index(self.replica)

    def begin_step(self, step: int) -> None:
        """The step's quorum; a group behind the quorum's step first loads a live peer's
        state (attach's load_state_dict), synchronously, so its step starts from it."""
        self._events = {"transfer_bytes": 0, "transfer_s": 0.0}
        start = time.perf_counter()
        self._manager.start_quorum()
        # A run starts from all R groups: before any commit, a quorum that is not full yet
        # (a group still starting) is asked again, until fault.quorum_timeout_s.
        deadline = start + self._quorum_timeout_s
        while self._manager.current_step() == 0 and self.live < self.replicas \
                and time.perf_counter() < deadline:
            time.sleep(0.05)
            self._manager.start_quorum()
        if self._events["transfer_bytes"]:  # quorum + transfer + load: the rejoin's cost
            self._events["transfer_s"] = time.perf_counter() - start
        world = self._mesh.world_size
        self._groups = sorted({r // world for r in self._pg.global_ranks}) or [self.replica]
        if self.replica not in self._groups:
            raise RuntimeError(f"replica group {self.replica} is not in its own quorum "
                               f"{self._groups}")
        previous = self._seen or self._groups
        self._events["lost"] = [g for g in previous if g not in self._groups]
        self._events["rejoined"] = [g for g in self._groups if g not in previous]
        self._seen = self._groups

    def all_reduce(self, tensors: list[torch.Tensor], op: Literal["sum", "avg"], *,
                   tag: str) -> None:
        """In place, one collective per dtype (the tensors packed into one buffer). torchft
        sums over the quorum's process group; avg then divides by the participants (the
        live groups: a group that is not participating contributes zeros)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"cross-replica all_reduce op {op!r}: sum or avg")
        from torch.distributed import ReduceOp

        reduce_op = ReduceOp.AVG if op == "avg" else ReduceOp.SUM
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        live = self.live
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in group])  # [sum numel]
            start = time.perf_counter()
            self._manager.allreduce(flat, reduce_op=reduce_op).wait()
            record = add_record(self._mesh.ledger, op="all_reduce", group="rep",
                                algorithm="torchft", dtype=str(dtype).removeprefix("torch."),
                                numel=flat.numel(), msg_bytes=flat.numel() * flat.element_size(),
                                p=live, is_root=False, tag=tag)
            record.time_s = time.perf_counter() - start
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self) -> bool:
        """torchft's commit protocol: True when no rank of any live group saw an error in
        the step (the caller then applies it; else it discards the step and redoes it)."""
        ok = self._manager.should_commit()
        self._events["committed"] = ok
        return ok

    def attach(self, state_dict: Callable[[], dict[str, Any]],
               load_state_dict: Callable[[dict[str, Any]], None]) -> None:
        def send() -> dict[str, Any]:
            state = state_dict()
            self._ledger_transfer("send", state)
            return {"config": self._fingerprint, "state": state}

        def receive(sent: dict[str, Any]) -> None:
            check_same_config(self._fingerprint, sent["config"])
            self._ledger_transfer("recv", sent["state"])
            load_state_dict(sent["state"])

        self._manager.register_state_dict_fn("shardtrain", receive, send)

    def _ledger_transfer(self, op: str, state: dict[str, Any]) -> None:
        nbytes = _state_bytes(state)
        add_record(self._mesh.ledger, op=op, group="rep", algorithm="torchft-http",
                   dtype="mixed", numel=0, msg_bytes=nbytes, p=2, is_root=False,
                   tag="rep:transfer")
        if op == "recv":
            self._events["transfer_bytes"] = nbytes
        else:
            self._events["sent_bytes"] = nbytes

    def events(self) -> dict[str, Any]:
        """quorum (live groups), groups (which), lost / rejoined (since the last step),
        transfer_bytes / transfer_s (this group received a peer's state), sent_bytes (it
        sent its own), committed."""
        out = {"quorum": len(self._groups), "groups": list(self._groups)}
        out.update({k: v for k, v in self._events.items() if v or k == "committed"})
        return out

    def close(self) -> None:
        self._manager.shutdown(wait=False)
