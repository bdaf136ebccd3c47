"""Top-k compression of optimizer updates (comm.compress=topk, parallel/data/topk.py):
one spawn of 2 processes runs every check that needs a real dp group.

- the compressor on the group: each tensor's (segment's) own top-k, the same result on every
  rank, error feedback losing nothing (applied + residual = every update), ledger bytes
  (p-1) x 8k;
- ratio 1.0 with AdamW applies the average of the ranks' local AdamW updates; with plain
  SGD (at ratio 1.0 momentum masking leaves no momentum) and no clipping it is the
  uncompressed data-parallel run, within the parity harness's tolerances; momentum is
  masked exactly at the entries the rank sent;
- at 1% after a sparsity warm-up: replicas stay bit-identical, the ledger shows (p-1) x 8k
  bytes per step (k following the warm-up), and 4 straight steps equal 2 steps + checkpoint
  + resume + 2 steps bitwise (each rank's optimizer state, residual and step count are
  saved); resuming in another layout is refused, naming the fields; a resumed residual
  joins its parameters' device.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny
from shardtrain.comm import CommLedger, Communicator
from shardtrain.comm.compress import TopKCompressor
from shardtrain.config import ConfigError
from shardtrain.parallel.data.topk import SparseUpdates, fraction_sent
from shardtrain.train.checkpoint.checkpoint import check_layout
from shardtrain.train.trainer import Trainer

WORLD = 2
SEGMENTS = (300, 50, 7)  # at 1%: 3 + 1 + 1 entries sent per call
CALLS = 3
SGD = ["--train.steps", "4", "--optim.name", "sgd", "--optim.momentum", "0", "--optim.grad_clip",
       "0", "--train.lr", "0.05"]
WARMUP = 3
TOPK = ["--train.steps", "4", "--comm.compress", "topk", "--comm.topk_ratio", "0.01",
        "--comm.topk_warmup_steps", str(WARMUP)]


def _local(rank: int, call: int) -> torch.Tensor:
    return torch.randn(sum(SEGMENTS), generator=torch.Generator().manual_seed(100 * call + rank))


def _trainer(tmp, name: str, rank: int, *overrides: str) -> Trainer:
    cfg = tiny(tmp, name, *overrides)
    return Trainer(cfg, make_mesh(cfg, rank, WORLD), torch.device("cpu"))


def _state(trainer: Trainer, losses: list[float], eval_loss: float | None) -> dict:
    grad = [r for r in trainer.mesh.ledger.records if r.tag.startswith("grad")]
    return {"losses": losses, "eval_loss": eval_loss, "weights": trainer.parallel.full_state_dict(),
            "grad_sent": [(r.tag, r.sent_bytes) for r in grad]}


def _linear(seed: int) -> tuple[nn.Linear, torch.optim.Optimizer]:
    layer = nn.Linear(6, 5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    return layer, torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)


def _adamw_steps(comm, ratio: float, steps: int) -> dict:
    """SparseUpdates with AdamW on a small layer, each rank its own gradients: the parameters
    after one step at ratio 1.0 are the start plus the average of the ranks' local AdamW
    updates; after each step the momentum is zero exactly at the entries sent."""
    layer, optimizer = _linear(seed=comm.rank)
    updates = SparseUpdates(comm, optimizer, None, ratio=ratio)  # no model: step() alone
    sent, masked = [], []
    for _ in range(steps):
        updates.step(0.01)
        sent.append(updates.compressor.sent.clone())
        masked.append(torch.cat([optimizer.state[p]["exp_avg"].flatten() == 0
                                 for p in updates.params]))
    expected = []
    for rank in range(comm.size):
        ref, ref_opt = _linear(seed=rank)
        for group in ref_opt.param_groups:
            group["lr"] = 0.01
        ref_opt.step()
        expected.append([p.detach().clone() for p in ref.parameters()])
    start = [p.detach() for p in _linear(0)[0].parameters()]
    mean = [s + sum(e[i] - s for e in expected) / comm.size for i, s in enumerate(start)]
    return {"got": [p.detach().clone() for p in layer.parameters()], "expected": mean,
            "sent": sent, "masked": masked}


def _checks(rank: int, world_size: int, tmp) -> dict:
    out = {}
    for name, extra in (("dense", []), ("ratio1", ["--comm.compress", "topk",
                                                   "--comm.topk_ratio", "1.0"])):
        trainer = _trainer(tmp, f"sgd-{name}", rank, *SGD, *extra)
        result = trainer.run()
        out[name] = _state(trainer, result.losses, result.eval_loss)
    # The compressor alone, on this dp group.
    c = TopKCompressor(0.01, segments=SEGMENTS)
    start, received = len(trainer.mesh.ledger.records), []
    for call in range(CALLS):
        x = _local(rank, call)
        trainer.dp.all_reduce(x, "avg", tag="check", compress=c)
        received.append(x)
    out["compressor"] = {"received": received, "residual": c.residual,
                         "sent": [r.sent_bytes for r in trainer.mesh.ledger.records[start:]]}
    out["adamw"] = _adamw_steps(trainer.dp, 1.0, 1)
    out["masking"] = _adamw_steps(trainer.dp, 0.3, 2)
    # 1%: straight, and split by a checkpoint.
    straight = _trainer(tmp, "topk-straight", rank, *TOPK)
    result = straight.run()
    out["straight"] = _state(straight, result.losses, result.eval_loss)
    out["numels"] = [p.numel() for p in straight.parallel.update.params]
    first = _trainer(tmp, "topk-split", rank, *TOPK)
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save()
    resumed = _trainer(tmp, "topk-split", rank, *TOPK, "--checkpoint.resume", "latest")
    result = resumed.run()
    out["split"] = _state(resumed, losses + result.losses, result.eval_loss)
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("compressed_update")


@pytest.fixture(scope="module")
def runs(tmp) -> list[dict]:
    return run_distributed(_checks, WORLD, tmp)


def _sparse(x: torch.Tensor) -> torch.Tensor:
    """Reference: each segment's largest 1% (at least one) kept, the rest zeroed."""
    out, start = torch.zeros_like(x), 0
    for n in SEGMENTS:
        k = max(1, math.ceil(0.01 * n))
        index = x[start:start + n].abs().topk(k).indices + start
        out[index] = x[index]
        start += n
    return out


def test_compressor_sends_each_segments_top_and_loses_nothing(runs):
    got = [r["compressor"] for r in runs]
    for call in range(CALLS):
        assert torch.equal(got[0]["received"][call], got[1]["received"][call])
    first = sum(_sparse(_local(r, 0)) for r in range(WORLD)) / WORLD
    torch.testing.assert_close(got[0]["received"][0], first, rtol=0, atol=0)
    applied = sum(got[0]["received"])
    produced = sum(_local(r, c) for r in range(WORLD) for c in range(CALLS)) / WORLD
    kept = sum(g["residual"] for g in got) / WORLD
    torch.testing.assert_close(applied + kept, produced, rtol=0, atol=1e-6)
    k = 3 + 1 + 1
    for g in got:
        assert int((g["residual"] == 0).sum()) == k  # the entries just sent
        assert g["sent"] == [(WORLD - 1) * 8 * k] * CALLS


def test_ratio_one_with_adamw_applies_the_mean_local_update(runs):
    for r in runs:
        for got, expected in zip(r["adamw"]["got"], r["adamw"]["expected"]):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        for got, other in zip(r["adamw"]["got"], runs[0]["adamw"]["got"]):
            assert torch.equal(got, other)
        assert r["adamw"]["masked"][0].all()  # everything was sent


def test_momentum_is_masked_exactly_where_this_rank_sent(runs):
    for r in runs:
        for sent, masked in zip(r["masking"]["sent"], r["masking"]["masked"]):
            expected = torch.zeros(masked.numel(), dtype=torch.bool)
            expected[sent] = True
            assert torch.equal(masked, expected)


def test_ratio_one_with_plain_sgd_is_the_uncompressed_run(runs):
    for rank, r in enumerate(runs):
        assert r["dense"]["losses"][-1] < r["dense"]["losses"][0]
        assert_parity(r["dense"], r["ratio1"], f"topk ratio 1.0 rank {rank}")


def test_warmup_falls_geometrically_from_a_quarter_to_the_ratio():
    assert fraction_sent(0, 0.01, 4) == 0.25
    assert fraction_sent(2, 0.01, 4) == pytest.approx(0.05)  # sqrt(0.25 x 0.01)
    assert fraction_sent(4, 0.01, 4) == fraction_sent(0, 0.01, 0) == 0.01
    assert fraction_sent(0, 0.5, 4) == 0.5


def test_one_percent_is_bit_identical_exact_in_bytes_and_resumes_bitwise(runs):
    ks = [sum(max(1, math.ceil(fraction_sent(step, 0.01, WARMUP) * n)) for n in runs[0]["numels"])
          for step in range(4)]
    for r in runs:
        assert r["straight"]["grad_sent"] == [("grad:topk", (WORLD - 1) * 8 * k) for k in ks]
        assert r["split"]["losses"] == r["straight"]["losses"]
        for name, w in r["straight"]["weights"].items():
            assert torch.equal(r["split"]["weights"][name], w), name
            assert torch.equal(runs[0]["straight"]["weights"][name], w), name


def test_resume_in_another_layout_is_refused(runs, tmp):
    path = tmp / "topk-split" / "checkpoints" / "step_00000002"
    check_layout(path, tiny(tmp, "same", *TOPK), WORLD)
    for overrides, world, needle in ((["--comm.compress", "none"], WORLD, "comm.compress=topk"),
                                     (TOPK, 1, "parallel.dp=2")):
        with pytest.raises(ConfigError, match=needle) as err:
            check_layout(path, tiny(tmp, "other", *overrides), world)
        assert "per-rank optimizer state and residual of comm.compress=topk" in str(err.value)
    with pytest.raises(ConfigError, match="no comm.compress=topk"):
        check_layout(tmp / "sgd-dense" / "checkpoints" / "step_00000004",
                     tiny(tmp, "other", *TOPK), WORLD)


def test_a_resumed_residual_joins_its_parameters_device():
    """Checkpoints are read to the host (map_location="cpu"); the residual, added to each
    step's update on the parameters' device, goes there (a meta device stands in for a
    GPU: a host residual added to a GPU update would raise at the first step)."""
    layer = nn.Linear(3, 2, device="meta")
    optimizer = torch.optim.AdamW(layer.parameters())
    comm = Communicator(None, name="dp", ranks=[0], ledger=CommLedger())
    updates = SparseUpdates(comm, optimizer, None, ratio=0.5)
    saved = {"optimizer": optimizer.state_dict(),
             "updates": {"residual": torch.ones(8), "steps": 3}}  # as read: on the host
    updates.load_optimizer_files(lambda name: saved)
    assert updates.compressor.residual.device.type == "meta" and updates.steps == 3
