"""`parallel.zero_unit_blocks` = k: ZeRO-3 units of k transformer blocks, read on rank 0 of
an 8-rank dry run (train/start/dryrun.py: the real units, gatherer and ledger over a fake
process group; no spawn). Finer units cost a collective each, coarser ones peak memory
(seed 003's FSDP unit size): the runtime's all-gathers and its measured step peak follow
k, and so do the planner's (plan/buffers.py `block_units`, plan/traffic.py). Parity with
one process: the k = 2 row of test_zero.py."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from parity import tiny
from shardtrain.config import ConfigError
from shardtrain.cost.hardware import GENERIC_PCIE
from shardtrain.plan.layout import config_layout
from shardtrain.plan.traffic import step_ops
from shardtrain.train.start import dryrun
from shardtrain.train.start.meters import malloc_in_use_bytes

WORLD, LAYERS, STEPS = 8, 8, 2
# parameter-heavy (tests/test_dryrun_matrix.py's shape): 8 blocks of 3.2 MB dominate
PARAMS = ("--model.dim", "256", "--model.n_layers", str(LAYERS), "--model.n_heads", "4",
          "--model.n_kv_heads", "2", "--model.tie_embeddings", "false",
          "--model.vocab_size", "1024", "--model.max_seq_len", "64", "--train.seq_len", "16",
          "--train.micro_batch", "2", "--comm.bucket_mb", "1", "--parallel.zero", "3",
          "--train.global_batch", "16", "--train.steps", str(STEPS))
MARGIN_RATIO, MARGIN_BYTES = 0.03, 2**19  # test_dryrun_matrix.py's


@pytest.mark.skipif(malloc_in_use_bytes() is None,
                    reason="the CPU step peak needs glibc's mallinfo2 (glibc >= 2.33)")
def test_unit_blocks_set_gathers_and_peak(tmp_path, capsys, monkeypatch):
    trainers = []
    opened = dryrun.rank0_trainer

    @contextmanager
    def keep(*args, **kwargs):  # the dry run's trainer, to read its units and ledger after
        with opened(*args, **kwargs) as trainer:
            trainers.append(trainer)
            yield trainer

    monkeypatch.setattr(dryrun, "rank0_trainer", keep)
    rows = {}
    for k in (1, 2, LAYERS):
        cfg = tiny(tmp_path, f"k{k}", *PARAMS, "--parallel.zero_unit_blocks", str(k))
        report = dryrun.dry_run(cfg, WORLD, torch.device("cpu"), steps=STEPS)
        capsys.readouterr()
        trainer = trainers[-1]
        units = trainer.parallel.update.units
        gathers = sum(r.op == "all_gather" and r.tag == "param"
                      for r in trainer.mesh.ledger.records)
        layout = config_layout(cfg, WORLD)
        plan = [op for op in step_ops(cfg.model, layout, GENERIC_PCIE, seq_len=cfg.train.seq_len)
                if op.group == "dp" and op.op == "all_gather"]
        rows[k] = (len(units), gathers, plan[0].calls, report["measured"]["step_peak"],
                   report["planned_estimate"]["total"])
    for k, (n_units, gathers, planned, peak, total) in rows.items():
        print(f"k={k}: {n_units} units, {gathers // STEPS} all-gathers per step (planner: "
              f"{planned} for the blocks), step peak {peak / 1e6:.2f} MB, planner "
              f"{total / 1e6:.2f} MB")
        blocks = -(-LAYERS // k)
        assert n_units == blocks + 2  # the embedding and head units besides the blocks'
        # before forward and backward, m = 1, but the embedding's (forward only: its backward
        # reads the token ids, not the table)
        assert gathers == STEPS * (2 * n_units - 1)
        # The planner prices the model as its block units (it folds embedding and head in).
        assert planned == 2 * blocks
        assert peak <= total * (1 + MARGIN_RATIO) + MARGIN_BYTES
    peaks = [rows[k][3] for k in (1, 2, LAYERS)]
    totals = [rows[k][4] for k in (1, 2, LAYERS)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]  # coarser units: higher peak
    assert totals == sorted(totals) and totals[0] < totals[-1]


@pytest.mark.parametrize("overrides", [
    ["--parallel.zero", "2", "--parallel.zero_unit_blocks", "2"],
    ["--parallel.zero", "3", "--parallel.zero_unit_blocks", "0"],
])
def test_unit_blocks_config_errors(tmp_path, overrides):
    with pytest.raises(ConfigError, match="parallel.zero_unit_blocks"):
        tiny(tmp_path, "bad", *overrides).validate(2)
