"""Seed 002's one-state optimizers, torch's RMSprop and Adagrad (`optim.name`), on every
path that steps an optimizer: plain data parallelism (torch's own), ZeRO-1 and ZeRO-3 (the
shard optimizer, parallel/zero/optim.py) and ZeRO-2 with its state offloaded to the host
(parallel/zero/offload.py), each against one process, fp32, on 2 ranks in one spawn. ZeRO-2
on the device is in test_zero.py's README-tier rows; the host optimizer equals torch's step
for step in test_zero_offload.py."""

from __future__ import annotations

import pytest

from dist import run_distributed
from parity import assert_parity, reference_runs, tiny, train_layouts
from shardtrain import config

OPTIMS = {"rmsprop": ("--optim.name", "rmsprop", "--optim.rms_alpha", "0.9"),
          "adagrad": ("--optim.name", "adagrad", "--optim.adagrad_lr_decay", "0.05")}
LAYOUTS = {"dp": ("--parallel.zero", "0"), "zero1": ("--parallel.zero", "1"),
           "zero3": ("--parallel.zero", "3"),
           "zero2 offload cpu": ("--parallel.zero", "2", "--parallel.offload", "cpu")}


@pytest.mark.slow
def test_rmsprop_and_adagrad_on_every_path_match_one_process(tmp_path):
    def text(name: str, *overrides: str) -> str:
        return config.to_toml(tiny(tmp_path, name, "--train.steps", "3",
                                   "--train.global_batch", "8", *overrides))

    rows = [(o, l) for o in OPTIMS for l in LAYOUTS]
    per_rank = run_distributed(train_layouts, 2, [text(f"{o}-{i}", *OPTIMS[o], *LAYOUTS[l])
                                                  for i, (o, l) in enumerate(rows)])
    reference = reference_runs(text)
    for i, (o, l) in enumerate(rows):
        for rank, results in enumerate(per_rank):
            assert_parity(reference(OPTIMS[o]), results[i], f"{o} {l} rank {rank}")
        print(f"{o} {l}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
