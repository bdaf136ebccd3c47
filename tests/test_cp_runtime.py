"""Context parallelism as the planner sees it: the ledger's cp bytes per step equal the
planner's exactly (ring and Ulysses, fp32 and bf16, with and without full recomputation),
each rank's attention time lands in its timeline, and the activation bytes one rank saves
for backward at cp=4 are at most 0.3x those at cp=1 (measured with the saved-activation
meter, printed next to the planner's figure)."""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from parity import make_mesh, tiny
from shardtrain.parallel.activation import SavedActivations
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.plan.layout import Layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.traffic import cp_bytes_per_step
from shardtrain.train.trainer import Trainer

# (label, overrides): each a one-step run at cp=2 on 2 processes.
LEDGER_ROWS = [
    ("ring fp32", ["--parallel.cp_mode", "ring"]),
    ("ring bf16 full recompute", ["--parallel.cp_mode", "ring", "--train.precision", "bf16",
                                  "--train.activation_checkpointing", "full"]),
    ("ulysses fp32 full recompute", ["--parallel.cp_mode", "ulysses",
                                     "--train.activation_checkpointing", "full"]),
    ("ulysses bf16 contiguous", ["--parallel.cp_mode", "ulysses", "--train.precision", "bf16",
                                 "--parallel.cp_split", "contiguous"]),
]
SEQ = 256  # the memory comparison: long enough that activations dominate what is saved


def _ledger(rank: int, world_size: int, tmp) -> list[dict]:
    out = []
    for i, (label, overrides) in enumerate(LEDGER_ROWS):
        cfg = tiny(tmp, f"ledger-{i}-r{rank}", "--parallel.cp", str(world_size), *overrides)
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
        start = len(trainer.mesh.ledger.records)  # construction's traffic aside
        trainer.train_step()
        cp = [r for r in trainer.mesh.ledger.records[start:] if r.group == "cp"]
        out.append({"sent": sum(r.sent_bytes for r in cp),
                    "attention_s": trainer.parallel.timeline["attention_s"]})
    return out


def _layout(cfg, world_size: int) -> Layout:
    t, p = cfg.train, cfg.parallel
    return Layout(dp=p.resolved_dp(world_size), cp=p.cp, cp_mode=p.cp_mode,
                  micro_batch=t.micro_batch, microbatches=p.microbatches,
                  precision="fp32" if t.precision == "fp32" else "amp",
                  recompute=t.activation_checkpointing)


def test_ledger_cp_bytes_equal_the_planner(tmp_path):
    per_rank = run_distributed(_ledger, 2, tmp_path)
    for i, (label, overrides) in enumerate(LEDGER_ROWS):
        cfg = tiny(tmp_path, "plan", "--parallel.cp", "2", *overrides)
        cfg.validate(2)
        planned = cp_bytes_per_step(cfg.model, _layout(cfg, 2), cfg.train.seq_len)
        for rank, rows in enumerate(per_rank):
            print(f"{label} rank {rank}: ledger {rows[i]['sent']} B, planner {planned:.0f} B, "
                  f"attention {rows[i]['attention_s'] * 1e3:.1f} ms")
            assert rows[i]["sent"] == planned, label
            assert rows[i]["attention_s"] > 0, label


def _activation_bytes(rank: int, world_size: int, tmp) -> int:
    """Bytes autograd saves in one micro-batch's forward on this rank (tiny model at SEQ
    tokens, split over world_size cp ranks)."""
    cfg = tiny(tmp, f"act-{world_size}-r{rank}", "--parallel.cp", str(world_size),
               "--train.seq_len", str(SEQ), "--model.max_seq_len", str(SEQ),
               "--train.micro_batch", "1", "--train.global_batch", "1")
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    pipeline, model = trainer.parallel.pipeline, trainer.parallel.module
    (inputs, targets), _ = pipeline._mine(trainer.sampler.next_step()[0])  # (no MTP)
    with SavedActivations(exclude=model) as meter:
        loss = cross_entropy(model(inputs), targets)
    with trainer.parallel.update.no_sync():  # no gradient all-reduce left in flight
        loss.backward()  # every cp rank takes part in the ring's backward
    return meter.bytes


def test_cp4_activation_bytes_per_rank(tmp_path):
    one = _activation_bytes(0, 1, tmp_path)
    four = run_distributed(_activation_bytes, 4, tmp_path)
    cfg = tiny(tmp_path, "plan", "--train.seq_len", str(SEQ), "--model.max_seq_len", str(SEQ))
    plan = {cp: memory_per_gpu(cfg.model, Layout(cp=cp, precision="fp32"), seq_len=SEQ)
            for cp in (1, 4)}
    ratio = max(four) / one
    print(f"activation bytes saved per rank, one micro-batch of {SEQ} tokens: cp=1 {one} B "
          f"(planner {plan[1].activations:.0f} B), cp=4 {four} B (planner "
          f"{plan[4].activations:.0f} B); ratio {ratio:.3f}")
    assert ratio <= 0.3
