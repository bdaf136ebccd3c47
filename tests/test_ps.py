"""The parameter server (shardtrain/parallel/ps/) on a small linear model whose updates can
be computed by hand: async applies exactly the updates its arrival order implies, SSP never
lets a worker run more than s steps ahead, layer priority delivers the first layer's
weights first, and one server receives N x model bytes per step, 1/S of it with S servers.
Parity of the real trainer against one process: test_ps_parity.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from dist import run_distributed
from torch import nn

from shardtrain import config
from shardtrain.comm import CommLedger
from shardtrain.config import ConfigError, OptimConfig
from shardtrain.parallel.ps.codec import PushCodec
from shardtrain.parallel.ps.groups import ps_comms
from shardtrain.parallel.ps.layout import PSLayout, check_servers
from shardtrain.parallel.ps.server import ParameterServer
from shardtrain.parallel.ps.worker import PSWorker

LR = 0.05
SGD = OptimConfig(name="sgd", momentum=0.0, weight_decay=0.0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 1, bias=False))


def _data(w: int, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * w + clock)
    return torch.randn(3, 6, generator=g), torch.randn(3, 1, generator=g)


def _loss(model: nn.Module, w: int, clock: int) -> torch.Tensor:
    x, y = _data(w, clock)
    return (model(x) - y).square().mean()


def _scenario(rank: int, world: int, s: dict) -> dict:
    """One parameter-server run: workers train `steps` steps, sleeping delays[w][clock]
    before each; the servers serve. Returns what each side recorded."""
    ledger = CommLedger()
    world_comm, servers = ps_comms(rank, world, s["servers"], ledger, timeout_s=60)
    g = SimpleNamespace(world=world_comm, servers=servers, is_server=rank >= world - s["servers"],
                        index=rank - (world - s["servers"]) if rank >= world - s["servers"] else rank)
    model = _model()
    params = list(model.parameters())
    layout = PSLayout(params, workers=world - s["servers"], servers=s["servers"],
                      partition_bytes=s.get("partition_bytes", 1 << 20))
    codec = PushCodec(s.get("compress", "none"), [p.numel for p in layout.parts])
    if g.is_server:
        server = ParameterServer(g.world, g.servers, layout, g.index, params, SGD, codec=codec,
                                 mode=s["mode"], staleness=s.get("staleness", 0),
                                 priority=s.get("priority", "layer"), steps=s["steps"],
                                 lr_of=lambda c: LR)
        server.run()
        got = [r for r in ledger.records if r.op == "recv" and r.tag.startswith("ps:g")]
        return {"records": server.records, "push_bytes": sum(r.recv_bytes for r in got),
                "shard_bytes": layout.server_bytes(g.index)}
    worker = PSWorker(model, g.world, layout, codec=codec, priority=s.get("priority", "layer"),
                      credit=s.get("credit", 2))
    first = {p.index for p in layout.parts if p.param == 0}
    for clock in range(s["steps"]):
        time.sleep(s.get("delays", {}).get(g.index, [0.0] * s["steps"])[clock])
        worker.zero_grad()
        _loss(model, g.index, clock).backward()
        worker.finish()
    worker.settle()
    worker.remove_hooks()
    order = [[j in first for j, _ in step] for step in worker.timeline]
    return {"weights": [p.detach().clone() for p in params], "first_layer_order": order}


def _replay(order: list[tuple[int, int, int]]) -> list[list[torch.Tensor]]:
    """The updates an arrival order implies: for each (worker, clock, computed_on) in
    order, W <- W - lr x grad of that worker's clock-th loss at version computed_on.
    Returns every version of the weights."""
    model = _model()
    versions = [[p.detach().clone() for p in model.parameters()]]
    for w, clock, computed_on in order:
        with torch.no_grad():
            for p, v in zip(model.parameters(), versions[computed_on]):
                p.copy_(v)
        model.zero_grad()
        _loss(model, w, clock).backward()
        versions.append([v - LR * p.grad for v, p in zip(versions[-1], model.parameters())])
    return versions


def _three_ranks(rank: int, world: int) -> list[dict]:
    slow = {1: [0.8, 0.0, 0.0]}  # worker 1 pushes its first step well after worker 0's two
    return [_scenario(rank, world, s) for s in (
        dict(servers=1, mode="async", steps=3, delays=slow),
        dict(servers=1, mode="ssp", staleness=1, steps=6, delays={1: [0.3] * 6}),
        dict(servers=1, mode="sync", steps=2, priority="layer", partition_bytes=16, credit=1),
        dict(servers=1, mode="sync", steps=2, priority="none", partition_bytes=16, credit=1),
        dict(servers=1, mode="sync", steps=2, compress="int8"),
    )]


def _four_ranks(rank: int, world: int) -> list[dict]:
    return [_scenario(rank, world, dict(servers=2, mode="sync", steps=2, partition_bytes=24))]


def test_async_ssp_priority_and_incast():
    w0, w1, server = run_distributed(_three_ranks, 3)
    # Async: the server applied each push as it arrived; the final weights are those of
    # replaying that order by hand, and the order is the one the delays imply.
    records = server[0]["records"]
    order = [(r["worker"], r["clock"], r["computed_on"]) for r in records]
    assert order == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 0), (1, 1, 4), (1, 2, 5)]
    assert [r["staleness"] for r in records] == [0, 0, 0, 3, 0, 0]
    versions = _replay(order)  # worker 0 last pulled version 3, worker 1 version 6
    torch.testing.assert_close(w0[0]["weights"], versions[3], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w1[0]["weights"], versions[6], rtol=1e-6, atol=1e-7)
    # SSP, s = 1, worker 1 slow: worker 0 runs ahead, never by more than one step.
    ssp = server[1]["records"]
    assert all(r["clock"] - r["computed_on"] <= 1 for r in ssp)
    assert any(r["clock"] - r["computed_on"] == 1 for r in ssp)  # the bound was reached
    assert max(r["staleness"] for r in ssp) == 1
    # Priority: with layer priority every step's first-layer partitions arrive before the
    # last layer's; without (FIFO, the order backward produced them) they arrive last.
    for w in (w0, w1):
        assert all(step == sorted(step, reverse=True) for step in w[2]["first_layer_order"])
        assert all(step == sorted(step) for step in w[3]["first_layer_order"])
        assert all(step[0] and not step[-1] for step in w[2]["first_layer_order"])
    # Incast: one server receives every worker's whole gradient each step.
    model_bytes = 4 * sum(p.numel() for p in _model().parameters())
    assert server[2]["push_bytes"] == 2 * 2 * model_bytes  # N = 2 workers x 2 steps
    # Sync: both workers end with the same weights (the replay of synchronous steps).
    torch.testing.assert_close(w0[2]["weights"], w1[2]["weights"], rtol=0, atol=0)
    # int8 on push: the server receives one byte per value and a 4-byte scale per block.
    numels = [p.numel() for p in _model().parameters()]  # one partition per parameter here
    wire = sum(-(-n // 256) * (256 + 4) for n in numels)
    assert server[4]["push_bytes"] == 2 * 2 * wire
    torch.testing.assert_close(w0[4]["weights"], w1[4]["weights"], rtol=0, atol=0)


def test_two_servers_halve_the_incast():
    *workers, s0, s1 = run_distributed(_four_ranks, 4)
    model_bytes = 4 * sum(p.numel() for p in _model().parameters())
    got = [s0[0]["push_bytes"], s1[0]["push_bytes"]]
    assert got == [2 * 2 * s0[0]["shard_bytes"], 2 * 2 * s1[0]["shard_bytes"]]
    assert sum(got) == 2 * 2 * model_bytes and got[0] == got[1]  # N x model / S each
    torch.testing.assert_close(workers[0][0]["weights"], workers[1][0]["weights"], rtol=0,
                               atol=0)


@pytest.mark.parametrize("world, args, needle", [
    (2, ["--parallel.ps_servers", "2"], "parallel.ps_servers=2 leaves no workers"),
    (3, ["--parallel.ps_servers", "1", "--parallel.tp", "2"], "parallel.tp=2"),
    (3, ["--parallel.ps_servers", "1", "--parallel.pp", "2"], "parallel.pp=2"),
    (3, ["--parallel.ps_servers", "1", "--parallel.zero", "1"], "parallel.zero=1"),
    (3, ["--parallel.ps_servers", "1", "--parallel.cp", "2"], "parallel.cp=2"),
    (3, ["--parallel.ps_servers", "1", "--parallel.ep", "2"], "parallel.ep=2"),
    (3, ["--parallel.ps_servers", "-1"], "parallel.ps_servers=-1 must be >= 0"),
    (3, ["--parallel.ps_mode", "async"], "parallel.ps_mode=async applies to a parameter server"),
    (3, ["--parallel.ps_servers", "1", "--parallel.ps_staleness", "2"],
     "parallel.ps_staleness=2 must be >= 0 and applies to parallel.ps_mode=ssp only"),
    (3, ["--parallel.ps_servers", "1", "--parallel.ps_credit", "0"], "parallel.ps_credit=0"),
    (3, ["--parallel.ps_servers", "1", "--train.precision", "fp16"], "train.precision=fp16"),
    (2, ["--train.slow_ranks", "1-1.5"], "train.slow_ranks='1-1.5': '1-1.5' is not RANK:FACTOR"),
    (2, ["--train.slow_ranks", "3:1.5"], "rank 3 must lie in 0..1"),
    (2, ["--train.slow_ranks", "1:0.5"], "its factor 0.5 be >= 1"),
])
def test_bad_input_names_the_field(tmp_path, world, args, needle):
    cfg = config.load("tiny", args)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)
    assert needle in str(e.value)


def test_servers_outnumbering_parameters_and_good_layouts():
    cfg = config.load("tiny", ["--parallel.ps_servers", "1"])
    cfg.validate(3)
    assert cfg.parallel.resolved_dp(3) == 2  # the servers are not data-parallel ranks
    config.load("tiny", ["--parallel.ps_servers", "2", "--parallel.ps_mode", "ssp",
                         "--parallel.ps_staleness", "2", "--train.slow_ranks", "1:1.5"]).validate(4)
    cfg = config.load("tiny", ["--parallel.ps_servers", "2"])
    cfg.model.vocab_size, cfg.model.dim, cfg.model.n_layers = 1, 1, 0  # 3 parameters
    cfg.model.n_heads = cfg.model.n_kv_heads = 1
    cfg.parallel.ps_servers = 4
    with pytest.raises(ConfigError, match="parallel.ps_servers=4 outnumbers the model's 3"):
        check_servers(cfg)  # run by train/start/prepare.py prepare_run (it needs the parameter count)


def test_slow_ranks_stretch_compute(monkeypatch):
    """A 1.5x straggler sleeps 0.5 x (forward + backward) after each forward, measured in
    thread CPU time (a fake clock here: 2 s per forward)."""
    from shardtrain.train.observe import straggler

    clock, slept = iter([10.0, 12.0, 20.0, 22.0]), []
    monkeypatch.setattr(straggler.time, "thread_time", lambda: next(clock))
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    model = nn.Linear(2, 2)
    assert straggler.slow_down(model, 1.0) == []
    handles = straggler.slow_down(model, 1.5)
    model(torch.zeros(1, 2))
    model(torch.zeros(1, 2))
    assert slept == [0.5 * 3 * 2.0, 0.5 * 3 * 2.0]
    for h in handles:
        h.remove()


def test_planner_server_bytes_fall_as_one_over_s():
    """The planner's busiest server receives N x model bytes / S per step (ceil when the
    parameters do not split evenly, as the runtime's byte ranges), against the ring's
    2 (N-1)/N x model bytes per rank."""
    from shardtrain.cost.counts import param_counts
    from shardtrain.plan.layout_text import parse_layout
    from shardtrain.plan.ps import ps_summary

    model = config.load("tiny").model
    total = param_counts(model).total
    for s in (1, 2, 3, 4):
        lay = parse_layout(f"ps_servers={s}", gpus=4 + s, global_batch=8, precision="fp32")
        got = ps_summary(model, lay)
        assert got["server_recv_bytes_per_step"] == 4 * 4 * -(-total // s)
        assert got["ring_all_reduce_bytes_per_rank"] == 2 * 3 / 4 * 4 * total


def test_push_compression_codecs():
    """int8 keeps each value within half a step of its block's scale; top-k with error
    feedback loses nothing, only delays it (pushed + kept = every gradient); top-k of
    everything is the identity."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    int8 = PushCodec("int8", [1000], block=256)
    payload = int8.encode(0, grads[0])
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * 256 + 4 * 4
    scale = grads[0].abs().max() / 127
    assert (int8.decode(0, payload) - grads[0]).abs().max() <= scale / 2 + 1e-6
    topk = PushCodec("topk", [1000], ratio=0.05)
    pushed = sum(topk.decode(0, topk.encode(0, x)) for x in grads)
    assert topk.empty(0, torch.device("cpu")).numel() == 2 * 50
    torch.testing.assert_close(pushed + topk.residual[0], sum(grads), rtol=0, atol=1e-5)
    everything = PushCodec("topk", [1000], ratio=1.0)
    torch.testing.assert_close(everything.decode(0, everything.encode(0, grads[1])), grads[1],
                               rtol=0, atol=0)
