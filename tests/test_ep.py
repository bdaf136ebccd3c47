"""Expert parallelism (parallel/expert/): the cross-rank exchange returns what a local
dispatch/combine returns, parity with the single-process MoE run (losses, eval loss, final
weights), the ledger's ep all-to-all bytes, and the layouts config validation refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtrain import config
from shardtrain.comm import build_mesh
from shardtrain.config import ConfigError
from shardtrain.mesh import MeshShape
from shardtrain.model.moe import Routing, combine, dispatch
from shardtrain.parallel.expert.layers import run_experts
from tests.dist import run_distributed
from tests.parity import assert_parity, tiny, train_layout, train_layouts

E, K, T, C = 8, 2, 12, 4


def _routing(gen: torch.Generator) -> Routing:
    """Random distinct experts per token, weights 1/K (so K identity slots sum to x)."""
    logits = torch.randn(T, E, generator=gen)
    probs = logits.softmax(-1)
    experts = probs.topk(K, dim=-1).indices
    return Routing(logits, probs, torch.full((T, K), 1.0 / K), experts)


def _exchange(rank: int, world: int, ep: int) -> list[str]:
    """Identity experts: dispatch -> all-to-all -> experts -> all-to-all -> combine returns
    the input and its gradient; experts scaling by (global expert + 1): the local result,
    dropless and under capacity. Returns failures (empty: all held)."""
    mesh = build_mesh(MeshShape(dp=world, ep=ep), rank=rank)
    comm = mesh.comm("ep")
    local_experts = E // ep
    gen = torch.Generator().manual_seed(100 + rank)
    failures = []
    for cap in (None, 2):
        x = torch.randn(T, C, generator=gen, requires_grad=True)
        r = _routing(gen)
        xs, d = dispatch(x, r, cap)
        out = combine(run_experts(xs, d, comm, lambda h, _: h * 1), d, T)
        grad = torch.randn(T, C, generator=gen)
        out.backward(grad)
        kept = torch.zeros(T).index_add_(0, d.token, d.keep.float()) / K  # [T]
        if not torch.equal(out, x.detach() * kept[:, None]) or \
                not torch.equal(x.grad, grad * kept[:, None]):
            failures.append(f"identity ep={ep} cap={cap}")
        scaled = lambda h, ld: h * (comm.rank * local_experts + ld.expert + 1)[:, None]
        got = combine(run_experts(xs, d, comm, scaled), d, T)
        want = combine(xs * (d.expert + 1)[:, None], d, T)
        if not torch.allclose(got, want, rtol=1e-6, atol=0):
            failures.append(f"scaled ep={ep} cap={cap}")
        if cap is None and not bool((kept == 1).all()):
            failures.append("dropless dropped a slot")
    return failures


def _ep_records(trainer) -> dict:
    """The ep all-to-alls in the ledger, and the logged per-step grad norms (rank 0 writes
    metrics.jsonl): Adam barely sees a mis-scaled gradient, the norm does."""
    rows = [r for r in trainer.mesh.ledger.records if r.tag == "ep"]
    path = Path(trainer.cfg.train.run_dir) / "metrics.jsonl"
    logged = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.exists() else None
    norms = [r["grad_norm"] for r in logged] if logged else None
    dropped = sum(r["moe_dropped"] for r in logged) if logged else None
    return {"grad_norms": norms, "dropped": dropped,
            "ep_ops": sorted({(r.op, r.group) for r in rows}),
            "ep_sent_bytes": sum(r.sent_bytes for r in rows), "ep_calls": len(rows)}


def _world(rank: int, world: int, texts: list[str]) -> dict:
    eps = [e for e in (1, 2, 4) if e <= world]
    failures = [f for ep in eps for f in _exchange(rank, world, ep)]
    return {"exchange": failures, "runs": train_layouts(rank, world, texts, _ep_records)}


MOE = ("--model.n_experts", "4", "--model.moe_aux_loss_coef", "0.1",
       "--model.moe_z_loss_coef", "0.01", "--train.steps", "3", "--train.eval_every", "3")


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, *MOE, *overrides))


@pytest.mark.parametrize("world,rows", [
    (2, [("ep2", ("--parallel.ep", "2"))]),
    (4, [("ep2 x dp2", ("--parallel.ep", "2")), ("ep4", ("--parallel.ep", "4"))]),
])
def test_ep_exchange_and_parity(tmp_path, world, rows):
    reference = train_layout(0, 1, _text(tmp_path, "ref"), _ep_records)
    texts = [_text(tmp_path, f"{n.replace(' ', '')}-{world}", *o) for n, o in rows]
    per_rank = run_distributed(_world, world, texts)
    for rank, result in enumerate(per_rank):
        assert result["exchange"] == [], f"rank {rank}: {result['exchange']}"
        for (label, _), run in zip(rows, result["runs"]):
            assert_parity(reference, run, f"{label} rank {rank}")
            if run["grad_norms"] is not None:  # rank 0
                torch.testing.assert_close(torch.tensor(run["grad_norms"]),
                                           torch.tensor(reference["grad_norms"]), rtol=1e-5,
                                           atol=0, msg=f"{label}: grad norms differ")
            assert run["ep_ops"] == [("all_to_all", "ep")]
            assert run["ep_sent_bytes"] > 0
            # 2 MoE layers x (5 per training micro-batch: counts, slots and back forward,
            # the two swapped backward; 3 per eval forward): 3 steps of 8 / (2 world)
            # micro-batches of 2, one eval batch per rank.
            assert run["ep_calls"] == 2 * (5 * 3 * (8 // (2 * world)) + 3)
            print(f"{label} rank {rank}: ep all_to_all {run['ep_calls']} calls, "
                  f"{run['ep_sent_bytes']} bytes sent over 3 steps and the evals")


@pytest.mark.parametrize("world,overrides,field", [
    (4, ("--parallel.ps_servers", "2"), "parallel.ps_servers"),
    (2, ("--comm.compress", "topk"), "comm.compress"),
    (2, ("--lora.rank", "4"), "lora.rank"),
    (3, ("--parallel.ep", "3", "--train.global_batch", "6"), "model.n_experts"),
    (2, ("--parallel.ep", "4"), "parallel.ep"),  # must divide dp = 2
    (2, ("--parallel.tp", "2"), "parallel.ep"),  # dp x cp = 1
])
def test_config_errors(tmp_path, world, overrides, field):
    cfg = tiny(tmp_path, "bad", "--model.n_experts", "4", "--parallel.ep", "2", *overrides)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg.validate(world)
