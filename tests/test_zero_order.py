"""ZeRO's gradient launch order, its gradient buckets and ZeRO-3's prefetch under a pipeline,
read on rank 0 of an 8-rank job built in this one process over the dry run's fake process
group (train/start/dryrun.py: the real units, reducer, gatherer and ledger; no spawn).

- A tied token table completes its gradient only with the embedding's backward, the last:
  its unit (the head's) is launched last, so every other unit's reduce-scatter, and under
  ZeRO-3 its release, still overlaps backward (issue 39 found all 7 units of a 6-layer
  model gathered, and all 7 full gradients alive, until backward ended). Plain data
  parallelism's buckets have no such trap: the tied table sits in the last bucket.
- `comm.bucket_mb` sizes ZeRO's reduce-scatter buckets (whole consecutive units; a larger
  unit alone) at every stage, with a pipeline too: the ledger's collective count and sizes
  follow the planner's rule, the bytes and the shards do not change.
- `parallel.zero_prefetch` under a pipeline: the step's one gather of each unit runs that
  many events ahead of the stage's first forward, not all units before it.
Parity with one process under coalesced buckets: the rows of test_zero.py and
test_zero_pp.py (which run at the default bucket size, coalescing all of the tiny model).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from parity import tiny
from shardtrain.cost.units import coalesce
from shardtrain.plan.traffic import data_parallel_ops
from shardtrain.train.start.dryrun import rank0_trainer

WORLD = 8
ALONE = ("--comm.bucket_mb", "0.01")  # 10 KiB: every unit of the tiny model is larger


@contextmanager
def _rank0(tmp, name: str, *overrides: str):
    cfg = tiny(tmp, name, "--train.global_batch", str(2 * WORLD), "--train.steps", "2",
               *overrides)
    cfg.validate(WORLD)
    with rank0_trainer(cfg, WORLD, torch.device("cpu")) as trainer:
        yield trainer


def _launches(tmp, name: str, *overrides: str) -> tuple[list, list[str]]:
    """One step; at each unit's launch: (gradients still due in backward, units gathered,
    units holding full gradients); and the names of the last unit launched."""
    with _rank0(tmp, name, "--model.n_layers", "6", *ALONE, *overrides) as trainer:
        z = trainer.parallel.update
        seen, reducer = [], z.reducer
        launch = reducer._launch

        def spy(i: int) -> None:
            seen.append((sum(reducer.launcher.pending),
                         len(z.gatherer.live) if z.gatherer else 0,
                         sum(any(p.grad is not None for p in u.params) for u in z.units)))
            launch(i)

        reducer.launcher._launch = spy
        trainer.train_step()
        return seen, reducer.order[-1].names


@pytest.mark.parametrize("zero", [2, 3])
def test_tied_table_is_reduced_last(tmp_path, zero):
    for tied in (False, True):
        seen, last = _launches(tmp_path, f"z{zero}-{tied}", "--parallel.zero", str(zero),
                               "--model.tie_embeddings", str(tied).lower())
        print(f"zero{zero} tied={tied}: (due, gathered, full gradients) at each launch {seen}")
        assert len(seen) == 6 + (1 if tied else 2)  # blocks, head (with the tied table), embedding
        assert seen[0][0] > 0  # the first reduce-scatter overlaps backward
        assert max(full for _, _, full in seen) == 1  # one unit's full gradients at a time
        if zero == 3:  # the unit computing and the one prefetched (today's tied: 7 of 7)
            assert max(live for _, live, _ in seen) <= 2
        assert "tok_emb.weight" in last  # tied: the table's unit; untied: the embedding's


def test_data_parallel_buckets_have_no_tied_trap(tmp_path):
    """Plain DP's buckets follow registration order reversed; the tied table is registered
    at the embedding, so it is in the last bucket and the first launches mid-backward."""
    for tied in ("false", "true"):
        with _rank0(tmp_path, f"dp-{tied}", "--model.n_layers", "6", ALONE[0], "0.05",
                    "--model.tie_embeddings", tied) as trainer:
            reducer = trainer.parallel.update.reducer
            due, launch = [], reducer.launcher._launch
            reducer.launcher._launch = lambda i: (due.append(sum(reducer.launcher.pending)),
                                                  launch(i))
            trainer.train_step()
            weight = trainer.parallel.module.tok_emb.weight
        assert len(reducer.buckets) > 2 and due[0] > 0, (tied, due)
        assert any(p is weight for p in reducer.buckets[-1].params)


def _grad_records(trainer) -> list[int]:
    return [r.numel for r in trainer.mesh.ledger.records
            if r.op == "reduce_scatter" and r.tag == "grad" and r.group == "dp"]


@pytest.mark.parametrize("zero, pp, reduce", [(1, 1, "fp32"), (2, 1, "bf16"), (3, 1, "fp32"),
                                               (3, 2, "bf16")])
def test_bucket_mb_sizes_zero_reduce_scatters(tmp_path, zero, pp, reduce):
    """One step at three bucket sizes: alone (10 KiB), 300 KiB (150 in bf16), and 25 MiB
    (the whole tiny model in one). The collectives are the planner's buckets of the runtime's
    units (their gradient bytes in the reduce dtype); bytes, and the shards they leave, are
    the same."""
    layout = ("--parallel.zero", str(zero), "--model.n_layers", "4")  # 2 micro-batches:
    layout += ("--parallel.pp", "2", "--parallel.microbatches", "2") if pp > 1 else \
        ("--train.global_batch", str(4 * WORLD))
    if reduce == "bf16":
        layout += ("--train.precision", "bf16", "--train.grad_reduce_dtype", "bf16")
    width = 4 if reduce == "fp32" else 2
    runs = {}
    middle = "0.3" if reduce == "fp32" else "0.15"  # the same units in half the bytes
    for mb in ("0.01", middle, "25"):
        with _rank0(tmp_path, f"b{zero}{pp}-{mb}", *layout, "--comm.bucket_mb", mb) as trainer:
            trainer.train_step()
            z = trainer.parallel.update
            sizes = [width * u.padded for u in z.reducer.order]
            buckets = coalesce(sizes, float(mb) * 2**20)
            runs[mb] = (_grad_records(trainer), buckets, sizes,
                        torch.cat([u.grad_shard for u in z.units]))
        calls, buckets, sizes, _ = runs[mb]
        print(f"zero{zero} pp{pp} {reduce} bucket_mb {mb}: {len(calls)} reduce-scatters {calls} "
              f"of {len(sizes)} units")
        # one reduce-scatter per bucket (per micro-batch for ZeRO-2/3 without a pipeline)
        syncs = 2 if zero >= 2 and pp == 1 else 1
        assert calls == [sum(sizes[i] for i in b) // width for b in buckets] * syncs
    alone, middle, whole = (runs[mb] for mb in ("0.01", middle, "25"))
    assert len(alone[0]) > len(middle[0]) > len(whole[0]) == (2 if zero >= 2 and pp == 1 else 1)
    assert sum(alone[0]) == sum(middle[0]) == sum(whole[0])
    assert torch.equal(alone[3], whole[3]) and torch.equal(alone[3], middle[3])
    # the planner counts the same collectives for uniform units of the same total
    units = len(alone[2])
    plan = data_parallel_ops(params=sum(alone[2]) / width, size=WORLD // pp, zero=zero,
                             precision="fp32", layers=units, bucket_bytes=25 * 2**20,
                             pipelined=pp > 1, microbatches=2, reduce_dtype=reduce)
    assert [op.calls for op in plan if op.op == "reduce_scatter"] == [len(whole[0])]


def test_zero_prefetch_under_a_pipeline(tmp_path):
    """pp 2 x dp 4, ZeRO-3: units gathered when each block of stage 0 starts its first
    forward of the step, prefetch 0, 1 and 2 (before the fix every unit was gathered
    before the chunk's first forward, whatever zero_prefetch said)."""
    gathered = {}
    for prefetch in (0, 1, 2):
        with _rank0(tmp_path, f"pf{prefetch}", "--parallel.zero", "3", "--parallel.pp", "2",
                    "--parallel.microbatches", "2", "--model.n_layers", "8",
                    "--parallel.zero_prefetch", str(prefetch)) as trainer:
            gatherer, stage = trainer.parallel.update.gatherer, trainer.parallel.module
            seen = []
            for block in stage.layers.values():  # after the gatherer's own hook
                block.register_forward_pre_hook(
                    lambda m, a: seen.append(len(gatherer.live)) if len(seen) < 4 else None)
            trainer.train_step()
            units = len(trainer.parallel.update.units)
        gathered[prefetch] = seen
    print(f"units gathered at each of stage 0's 4 blocks' first forward: {gathered}")
    assert units == 5  # the embedding and 4 blocks
    # event k (0: the embedding, 1..4: the blocks) holds events 0..k + prefetch gathered
    for prefetch, seen in gathered.items():
        assert seen == [min(units, k + 1 + prefetch) for k in range(1, 5)], prefetch
