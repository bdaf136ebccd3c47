"""Data parallelism: parity with one process, gradients equal torch DDP's, exact ledgers,
overlap of bucket all-reduces with backward, and bitwise resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout, train_layouts
from shardtrain import config
from shardtrain.model.transformer import build_model
from shardtrain.plan.rank_states import runtime_adamw_fp32
from shardtrain.plan.traffic import bytes_per_step, data_parallel_ops
from shardtrain.train.trainer import Trainer

STEPS = "8"
# (label, overrides): global batch 8 of micro-batches of 2 -> accumulation 4/dp; 4/dp -> 1.
LAYOUTS = {
    2: [("dp2 accumulate", ["--train.global_batch", "8", "--train.micro_batch", "2"]),
        ("dp2 no-accumulate", ["--train.global_batch", "8", "--train.micro_batch", "4"])],
    4: [("dp4 accumulate", ["--train.global_batch", "16", "--train.micro_batch", "2"]),
        ("dp4 no-accumulate", ["--train.global_batch", "8", "--train.micro_batch", "2"])],
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("dp")


def _cfg(tmp, name, overrides):
    return tiny(tmp, name, "--train.steps", STEPS, "--comm.bucket_mb", "0.1", *overrides)


def _reference(tmp, overrides):
    return train_layout(0, 1, config.to_toml(_cfg(tmp, "ref-" + "-".join(overrides), overrides)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_parity_with_single_process(tmp, world_size):
    layouts = LAYOUTS[world_size]
    texts = [config.to_toml(_cfg(tmp, f"w{world_size}-{i}", o)) for i, (_, o) in enumerate(layouts)]
    per_rank = run_distributed(train_layouts, world_size, texts)
    for i, (label, overrides) in enumerate(layouts):
        reference = _reference(tmp, overrides)
        for rank, results in enumerate(per_rank):
            assert_parity(reference, results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")


# ---------------------------------------------------------------- one spawn, several checks


def _dp_mechanics(rank: int, world_size: int, tmp) -> dict:
    out = {}
    # 1. After one step, our gradients equal torch DDP's on the same model and data.
    cfg = _cfg(tmp, f"oracle{rank}", ["--train.global_batch", "8", "--train.micro_batch", "4"])
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    (inputs, targets), = trainer.sampler.next_step()
    trainer.parallel.forward_backward([(inputs, targets)])
    reference = DistributedDataParallel(build_model(cfg.model, seed=cfg.train.seed))
    F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
    ref_grads = dict(reference.module.named_parameters())
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7)
    out["oracle_params"] = len(ref_grads)

    # 2. Ledger and memory ledger of one full step with accumulation (4 micro-batches of 1).
    cfg = _cfg(tmp, f"ledger{rank}", ["--train.global_batch", "8", "--train.micro_batch", "1"])
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    launches = []
    all_reduce = trainer.dp.all_reduce

    def spy(tensor, *args, **kwargs):
        if kwargs.get("tag") == "grad":
            launches.append(sum(trainer.parallel.update.reducer.launcher.pending))
        return all_reduce(tensor, *args, **kwargs)

    trainer.dp.all_reduce = spy
    record = trainer.train_step()
    records = trainer.mesh.ledger.records
    out["grad_records"] = [(r.op, r.msg_bytes, r.sent_bytes, r.recv_bytes)
                           for r in records if r.tag == "grad"]
    out["bucket_numels"] = [b.buffer.numel() for b in trainer.parallel.update.reducer.buckets]
    out["pending_at_launch"] = launches
    out["n_params"] = sum(p.numel() for p in trainer.model.parameters())
    out["n_tensors"] = len(list(trainer.model.parameters()))
    out["record"] = record
    return out


def test_dp_mechanics(tmp):
    world = 2
    results = run_distributed(_dp_mechanics, world, tmp)
    for rank, r in enumerate(results):
        assert r["oracle_params"] > 0
        psi, numels = r["n_params"], r["bucket_numels"]
        padded = sum(numels)
        assert all(n % world == 0 for n in numels) and padded - psi < world * len(numels)
        # One all-reduce per bucket per optimizer step, none on the 3 accumulation micro-steps.
        grads = r["grad_records"]
        assert len(grads) == len(numels) > 1
        expected = 2 * (world - 1) * 4 * padded // world  # ring: 2(n-1)/n x gradient bytes
        sent = sum(g[2] for g in grads)
        print(f"rank {rank}: DP step sent {sent} B; 2(n-1)/n x 4 B x {padded} padded grads "
              f"= {expected} B ({psi} params, {padded - psi} padding)")
        assert sent == expected == sum(g[3] for g in grads)
        assert [g[1] for g in grads] == [4 * n for n in numels]
        # Overlap: the first bucket launched while later buckets still awaited gradients.
        assert r["pending_at_launch"][0] > 0
        # ... and the planner predicts exactly that volume.
        predicted = bytes_per_step(data_parallel_ops(params=padded, size=world, zero=0,
                                                     precision="fp32"))
        assert predicted["dp"]["all_reduce"] == pytest.approx(sent, abs=1)
        # Memory ledger vs what the dtypes imply (fp32 AdamW: m and v, plus a step scalar)
        # and vs the planner's model-state bytes for this layout.
        rec = r["record"]
        implied = {"params_bytes": 4 * psi, "grads_bytes": 4 * padded,
                   "optimizer_bytes": 8 * psi + 4 * r["n_tensors"], "master_bytes": 0}
        plan = runtime_adamw_fp32(psi, grad_padding=padded - psi, step_tensors=r["n_tensors"])
        planned = {"params_bytes": plan.params, "grads_bytes": plan.grads,
                   "optimizer_bytes": plan.optimizer, "master_bytes": plan.master}
        for key, value in implied.items():
            print(f"rank {rank}: {key} ledger {rec[key]} implied {value} planner {planned[key]}")
            assert rec[key] == value == planned[key]
        assert rec["comm_bytes"] >= expected and rec["peak_mem_bytes"] > 0


def _resume_check(rank: int, world_size: int, tmp) -> tuple[list[float], list[float]]:
    return resume_losses(tmp, rank, world_size, f"resume-w{world_size}")


def resume_losses(tmp, rank: int, world_size: int, name: str) -> tuple[list[float], list[float]]:
    """(losses of 8 straight steps, losses of 4 steps + checkpoint + resume + 4 steps)."""
    straight_cfg = _cfg(tmp, f"{name}-straight", [])
    straight = Trainer(straight_cfg, make_mesh(straight_cfg, rank, world_size),
                       torch.device("cpu")).run().losses
    split_cfg = _cfg(tmp, f"{name}-split", [])
    first = Trainer(split_cfg, make_mesh(split_cfg, rank, world_size), torch.device("cpu"))
    losses = [first.train_step()["loss"] for _ in range(4)]
    first.save()
    resumed_cfg = _cfg(tmp, f"{name}-split", ["--checkpoint.resume", "latest"])
    resumed = Trainer(resumed_cfg, make_mesh(resumed_cfg, rank, world_size), torch.device("cpu"))
    assert resumed.step == 4
    return straight, losses + resumed.run().losses


def test_resume_is_bitwise_dp2(tmp):
    for straight, split in run_distributed(_resume_check, 2, tmp):
        assert straight == split
