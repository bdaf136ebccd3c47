"""ZeRO-1/2/3: parity with one process (dp 2 and 4, gradient accumulation, activation
checkpointing, tied embeddings, tensor parallelism, sharded checkpoints), the memory ledger
against the ZeRO formulas, the bytes per step against DP's, ZeRO-3's bound on gathered
units, torch's ZeroRedundancyOptimizer and FSDP2 as peers, and the errors on bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout, train_layouts
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.cost.units import backward_reads_params
from shardtrain.model.transformer import build_model
from shardtrain.plan.memory import model_states
from shardtrain.plan.traffic import bytes_per_step, data_parallel_ops
from shardtrain.train.optim import build_optimizer, lr_at
from shardtrain.train.trainer import Trainer

STEPS = "3"
GPT2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0", "--model.tie_embeddings", "true")
# (label, reference overrides -- model and batch --, layout overrides). Global batch 8 of
# micro-batches of 2 over dp 2, 16 over dp 4: 2 accumulation micro-steps per step.
B8, B16 = ("--train.global_batch", "8"), ("--train.global_batch", "16")
LAYOUTS = {
    2: [("zero1 dp2", B8, ["--parallel.zero", "1"]),
        ("zero2 dp2", B8, ["--parallel.zero", "2", "--checkpoint.every", "2"]),
        ("zero3 dp2 checkpointed, prefetch 2", B8,
         ["--parallel.zero", "3", "--parallel.zero_prefetch", "2",
          "--train.activation_checkpointing", "full"]),
        ("zero3 dp2 gpt2 tied", (*B8, *GPT2), ["--parallel.zero", "3"]),
        # units of 2 blocks: blocks 0-1, then block 2 with the final norm
        ("zero3 dp2 2 blocks per unit", (*B8, "--model.n_layers", "3"),
         ["--parallel.zero", "3", "--parallel.zero_unit_blocks", "2"]),
        # seed 002's one-state optimizers (torch's RMSprop and Adagrad) on ZeRO's shards
        ("zero2 dp2 rmsprop", (*B8, "--optim.name", "rmsprop"), ["--parallel.zero", "2"]),
        ("zero2 dp2 adagrad", (*B8, "--optim.name", "adagrad", "--optim.adagrad_lr_decay",
                               "0.05"), ["--parallel.zero", "2"])],
    4: [("zero1 dp4", B16, ["--parallel.zero", "1"]),
        ("zero2 dp4", B16, ["--parallel.zero", "2"]),
        ("zero3 dp4", B16, ["--parallel.zero", "3"]),
        ("zero1 tp2 x dp2", B8, ["--parallel.zero", "1", "--parallel.tp", "2"]),
        ("zero3 tp2 x dp2", B8, ["--parallel.zero", "3", "--parallel.tp", "2"])],
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("zero")


def _text(tmp, name: str, *overrides: str) -> str:
    return config.to_toml(tiny(tmp, name, "--train.steps", STEPS, *overrides))


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_parity_with_single_process(tmp, world_size):
    layouts = LAYOUTS[world_size]
    texts = [_text(tmp, f"w{world_size}-{i}", *ref, *layout)
             for i, (_, ref, layout) in enumerate(layouts)]
    if world_size == 2:  # zero2 resumed from its own sharded step-2 checkpoint; zero3 bf16
        texts.append(_text(tmp, "w2-1", *B8, "--parallel.zero", "2", "--checkpoint.resume",
                           str(tmp / "w2-1" / "checkpoints" / "step_00000002")))
        texts.append(_text(tmp, "w2-bf16", *B8, "--parallel.zero", "3",
                           "--train.precision", "bf16"))
    per_rank = run_distributed(train_layouts, world_size, texts)
    refs: dict[tuple, dict] = {}
    for i, (label, ref, _) in enumerate(layouts):
        if ref not in refs:
            refs[ref] = train_layout(0, 1, _text(tmp, f"ref-{len(refs)}-{world_size}", *ref))
        for rank, results in enumerate(per_rank):
            assert_parity(refs[ref], results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
    if world_size == 2:
        resumed = {**refs[B8], "losses": refs[B8]["losses"][2:]}
        for rank, results in enumerate(per_rank):
            assert_parity(resumed, results[-2], f"zero2 resumed rank {rank}")
        # bf16 compute copies with fp32 master shards: close to fp32, not equal.
        bf16, fp32 = per_rank[0][-1]["losses"], refs[B8]["losses"]
        print(f"zero3 bf16: losses {[round(x, 5) for x in bf16]}")
        assert bf16 != fp32 and all(abs(b - f) < 0.01 * f for b, f in zip(bf16, fp32))


# ---------------------------------------------------------------- one spawn, several checks


def _cfg(tmp, name: str, *overrides: str):
    # dp 2, micro-batches of 2, global batch 4: one micro-batch per step (no accumulation).
    return tiny(tmp, name, "--train.steps", STEPS, "--train.global_batch", "4", *overrides)


def _one_step(tmp, rank: int, world_size: int, zero: int) -> dict:
    # Buckets of 10 KiB: every unit of the tiny model is larger, so each is reduced alone
    # (the default 25 MiB would coalesce them all: test_zero_order.py).
    cfg = _cfg(tmp, f"mech-z{zero}-r{rank}", "--parallel.zero", str(zero),
               "--comm.bucket_mb", "0.01")
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    pending_at_launch = []  # gradients still due in backward when each reduce-scatter starts
    if zero:
        unit_comm = trainer.parallel.update.unit_comm
        reduce_grads = unit_comm.reduce_grads

        def spy(*args, **kwargs):
            launcher = trainer.parallel.update.reducer.launcher  # None under stage 1
            pending_at_launch.append(sum(launcher.pending) if launcher else 0)
            return reduce_grads(*args, **kwargs)

        unit_comm.reduce_grads = spy
    record = trainer.train_step()
    out = {"record": record,
           "sent": {tag: sum(r.sent_bytes for r in trainer.mesh.ledger.records if r.tag == tag)
                    for tag in ("grad", "param")},
           "ops": sorted({(r.op, r.tag) for r in trainer.mesh.ledger.records}),
           "n_params": sum(p.numel() for p in trainer.model.parameters()),
           "pending_at_launch": pending_at_launch,
           "full_grads_left": sum(p.grad is not None for p in trainer.model.parameters())}
    if zero:
        z = trainer.parallel.update
        out["padded"] = sum(u.padded for u in z.units)
        out["n_units"] = len(z.units)
        out["lookup"] = sum(u.padded for u in z.units if not backward_reads_params(u.key))
        if z.gatherer is not None:
            out["max_live"] = z.gatherer.max_live
            out["held_after_step"] = [u.flat.untyped_storage().nbytes() for u in z.units]
    return out


def _peer_losses(tmp, rank: int, world_size: int, wrap) -> list[float]:
    """Losses of torch's own implementation (`wrap(model) -> (model, optimizer)`) on the data
    our trainer sees on this rank, with our schedule, clipping and loss averaging."""
    cfg = _cfg(tmp, f"peer-data-r{rank}")
    sampler = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu")).sampler
    model, optimizer = wrap(build_model(cfg.model, seed=cfg.train.seed), cfg.optim)
    t, o = cfg.train, cfg.optim
    losses = []
    for step in range(t.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, base_lr=t.lr, warmup=o.warmup_steps, total=t.steps,
                                min_ratio=o.min_lr_ratio)
        (inputs, targets), = sampler.next_step()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def _zero_redundancy(model, o):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in build_optimizer(model, o, 0.0).param_groups]
    optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=0.0,
                                        betas=(o.beta1, o.beta2), eps=o.eps)
    return DistributedDataParallel(model), optimizer


def _fsdp2(model, o):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, build_optimizer(model, o, 0.0)


def _zero_mechanics(rank: int, world_size: int, tmp) -> dict:
    out = {z: _one_step(tmp, rank, world_size, z) for z in (0, 1, 2, 3)}
    for z in (1, 3):  # full runs, for the peers
        cfg = _cfg(tmp, f"run-z{z}", "--parallel.zero", str(z))  # one run dir: shared
        out[f"losses{z}"] = Trainer(cfg, make_mesh(cfg, rank, world_size),
                                    torch.device("cpu")).run().losses
    out["zero_redundancy"] = _peer_losses(tmp, rank, world_size, _zero_redundancy)
    out["fsdp2"] = _peer_losses(tmp, rank, world_size, _fsdp2)
    return out


def test_zero_mechanics(tmp):
    world = 2
    results = run_distributed(_zero_mechanics, world, tmp)
    dp_sent = None
    for rank, r in enumerate(results):
        psi, padded, units = r[1]["n_params"], r[1]["padded"], r[1]["n_units"]
        assert padded % world == 0 and 0 <= padded - psi < world * units
        # Memory: the ledger's model-state bytes (fp32 AdamW) are the ZeRO formulas of the
        # planner applied to the padded count P: stage 1 4P + 4P + 8P/N_d, stage 2
        # 4P + (4 + 8)P/N_d, stage 3 16P/N_d (fp32: the parameters are the master weights,
        # so master = 0 and K = 8 bytes of Adam moments; 16 bytes/param without ZeRO).
        print(f"rank {rank}: Psi = {psi} params, P = {padded} padded ({units} units), "
              f"N_d = {world}")
        for z in (1, 2, 3):
            rec, plan = r[z]["record"], model_states(padded, nd=world, zero=z, precision="fp32")
            unpadded = model_states(psi, nd=world, zero=z, precision="fp32")
            for key in ("params", "grads", "master", "optimizer"):
                print(f"  zero{z} {key:9s} ledger {rec[key + '_bytes']:>8} = formula(P) "
                      f"{getattr(plan, key):>10.0f} (formula(Psi) {getattr(unpadded, key):.0f})")
                assert rec[key + "_bytes"] == getattr(plan, key)
            states = ("params", "grads", "master", "optimizer")
            total = sum(rec[k + "_bytes"] for k in states)
            dp_total = sum(r[0]["record"][k + "_bytes"] for k in states)
            print(f"  zero{z} total {total} B = {total / padded:.1f} B/param (DP: {dp_total} B)")
        # One reduce-scatter per unit; stages 2 and 3 launch theirs while backward still owes
        # gradients (overlapped) and keep no full gradients.
        assert len(r[1]["pending_at_launch"]) == units
        for z in (2, 3):
            assert len(r[z]["pending_at_launch"]) == units and r[z]["pending_at_launch"][0] > 0
            assert r[z]["full_grads_left"] == 0
        # ZeRO-3 holds at most prefetch + 2 units full, prefetches (more than one at a time),
        # and none after the step.
        print(f"  zero3 most units gathered at once: {r[3]['max_live']} of {units}")
        assert 2 <= r[3]["max_live"] <= 1 + 2
        assert r[3]["held_after_step"] == [0] * units
        # Communication per step: stages 1 and 2 move DP's 2(N-1)/N x gradient bytes
        # (reduce-scatter + all-gather of 4P bytes); stage 3 1.5x (+ a second all-gather),
        # less the untied table's (gathered for forward only: a lookup's backward reads ids).
        ring = (world - 1) * 4 * padded // world  # one ring pass over the fp32 model
        table = (world - 1) * 4 * r[3]["lookup"] // world
        sent = {z: r[z]["sent"]["grad"] + r[z]["sent"]["param"] for z in (1, 2, 3)}
        dp_sent = r[0]["sent"]["grad"]
        print(f"  bytes sent per step: DP {dp_sent}, zero1 {sent[1]}, zero2 {sent[2]}, zero3 "
              f"{sent[3]} (2(N-1)/N x 4P = {2 * ring}, x1.5 = {3 * ring}, less {table})")
        assert r[1]["sent"] == r[2]["sent"] == {"grad": ring, "param": ring}
        assert table > 0 and r[3]["sent"] == {"grad": ring, "param": 2 * ring - table}
        assert sent[3] == 1.5 * sent[1] - table
        assert dp_sent == pytest.approx(sent[1], rel=0.01)  # DP pads its buckets differently
        for z in (1, 2, 3):
            plan = bytes_per_step(data_parallel_ops(params=padded, size=world, zero=z,
                                                    precision="fp32", lookup=r[z]["lookup"]))
            plan = plan["dp"]
            assert sum(plan.values()) == pytest.approx(sent[z], abs=8)
        assert ("all_reduce", "grad") not in r[3]["ops"]
        # Peers: our stage 1 = DDP + ZeroRedundancyOptimizer; our stage 3 = FSDP2.
        print(f"  losses zero1 {r['losses1']}\n  ZeroRedundancyOptimizer {r['zero_redundancy']}"
              f"\n  zero3 {r['losses3']}\n  FSDP2 {r['fsdp2']}")
        torch.testing.assert_close(r["losses1"], r["zero_redundancy"], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["losses3"], r["fsdp2"], rtol=1e-5, atol=0)
        assert all(math.isfinite(x) for x in r["losses3"])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("overrides", "needle"), [
    (["--parallel.zero", "4"], "parallel.zero=4"),
    (["--parallel.zero", "-1"], "parallel.zero=-1"),
    (["--parallel.zero", "1", "--parallel.zero_prefetch", "2"], "parallel.zero_prefetch=2"),
    (["--parallel.zero", "2", "--comm.compress", "int8"], "comm.compress=int8"),
])
def test_zero_config_errors(tmp, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        tiny(tmp, "bad", *overrides).validate(2)
