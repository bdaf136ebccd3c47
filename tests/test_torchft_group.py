"""TorchftReplicas alone (parallel/replica/torchft_group.py): two single-process replica
groups as threads of this process, a lighthouse beside them (as torchft's own integration
tests run). One test, several checks, no process spawned: the default tier's budget."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from shardtrain.comm.ledger import CommLedger
from shardtrain.config import Config, ConfigError

torchft = pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

from shardtrain.parallel.replica.torchft_group import TorchftReplicas  # noqa: E402


def _cfg(**parallel) -> Config:
    cfg = Config()
    cfg.parallel.replicas = 2
    cfg.fault.mode = "replicas"
    cfg.fault.quorum_timeout_s = 20.0
    cfg.comm.timeout_s = 2.0  # a peer that left mid-step costs group 0 this much
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


class _Group:
    """One replica group of one process: its mesh (world 1), its weights, its step."""

    def __init__(self, replica: int, lighthouse: str, cfg: Config, weight: float):
        self.mesh = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"),
                                    ledger=CommLedger())
        self.w, self.step = torch.full((4,), weight), 0
        self.rep = TorchftReplicas(cfg, self.mesh, replica=replica, lighthouse=lighthouse)
        self.rep.attach(lambda: {"w": self.w.clone(), "step": self.step}, self._load)

    def _load(self, state: dict) -> None:
        self.w.copy_(state["w"])
        self.step = state["step"]

    def train_step(self) -> dict:
        """One step: the quorum, this group's gradient (its index + 1) averaged, applied."""
        self.rep.begin_step(self.step)
        grad = torch.full((4,), float(self.rep.replica + 1))
        self.rep.all_reduce([grad], "avg", tag="rep:grad")
        if self.rep.commit():
            self.w -= grad
            self.step += 1
        return {**self.rep.events(), "live": self.rep.live, "position": self.rep.position,
                "w": self.w.clone(), "step": self.step}


def _both(groups: list[_Group]) -> list[dict]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(_Group.train_step, groups))


def _alongside(g0: _Group, joiner: _Group) -> tuple[list[dict], Future]:
    """The joiner's first step (then it stops) in a thread while group 0 keeps stepping:
    a live group does not wait for a joiner, which enters one of its later quorums."""

    def join() -> dict:
        try:
            return joiner.train_step()
        finally:
            joiner.rep.close()  # group 0's next quorum then forms without it

    events = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(join)
        while not future.done():
            events.append(g0.train_step())
    return events, future


def test_torchft_replicas_quorum_loss_rejoin_and_refusal():
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                                  heartbeat_timeout_ms=500)
    try:
        # The first two groups advertise an address (fault.advertise), not the host's name:
        # group 1's rejoin below fetches group 0's state from it.
        advertised = _cfg()
        advertised.fault.advertise = "127.0.0.1"
        with ThreadPoolExecutor(2) as pool:  # Manager construction blocks on the store
            g0, g1 = pool.map(lambda r: _Group(r, lighthouse.address(), advertised, 10.0),
                              (0, 1))
        manager = g0.rep._manager
        assert manager._checkpoint_transport.address().startswith("http://127.0.0.1:")
        assert manager._manager.address().startswith("http://127.0.0.1:")
        # Two live groups: the mean of the gradients 1 and 2, bytes in the ledger.
        e0, e1 = _both([g0, g1])
        assert (e0["live"], e0["position"], e1["position"]) == (2, 0, 1)
        assert e0["groups"] == [0, 1] and e0["committed"] and "lost" not in e0
        assert torch.equal(g0.w, torch.full((4,), 8.5)) and torch.equal(g1.w, g0.w)
        rec = g0.mesh.ledger.records[-1]
        assert (rec.group, rec.tag, rec.msg_bytes, rec.sent_bytes) == ("rep", "rep:grad", 16, 16)

        # Group 1 dies: group 0 steps alone, its own gradient only.
        g1.rep.close()
        e0 = g0.train_step()
        while not e0.get("committed"):  # a quorum that still counted group 1 fails to commit
            e0 = g0.train_step()
        assert (e0["live"], e0["groups"], e0["lost"]) == (1, [0], [1])
        assert torch.equal(g0.w, torch.full((4,), 7.5)) and g0.step == 2

        # A fresh group 1 (step 0) rejoins: it receives group 0's state, then steps with it.
        g1 = _Group(1, lighthouse.address(), _cfg(), -1.0)
        events, joined = _alongside(g0, g1)
        e1 = joined.result()
        assert e1["transfer_bytes"] > 0 and e1["transfer_s"] > 0 and e1["committed"]
        assert e1["groups"] == [0, 1] and e1["position"] == 1
        e0 = next(e for e in events if e.get("rejoined"))
        assert e0["rejoined"] == [1] and e0["sent_bytes"] > 0 and e0["groups"] == [0, 1]
        # The joint step: from its first step back, group 1 equals group 0 bitwise.
        assert e1["step"] == e0["step"] and torch.equal(e1["w"], e0["w"])
        assert any(r.tag == "rep:transfer" and r.op == "recv" for r in g1.mesh.ledger.records)

        # A group with another config is refused when it rejoins, naming the field.
        bad = _Group(1, lighthouse.address(), _cfg(outer_lr=0.5, sync="diloco", sync_every=2),
                     0.0)
        _, refused = _alongside(g0, bad)
        with pytest.raises(ConfigError, match=r"parallel\.outer_lr = 0\.5 here but 0\.7"):
            refused.result()
        g0.rep.close()
    finally:
        lighthouse.shutdown()
