"""A DeepSeek-V3-like mixture of experts in the dry run (issue 44 part 8): rank 0 of a
64-rank job with ep = 8 (train/start/dryrun.py), 64 fine-grained routed experts and 2
shared ones, top-6 limited to 3 of 8 groups, the first block dense; under ZeRO-1, 2 and 3
its measured model states equal the planner's to the byte (experts sharded over the
expert-data-parallel group, everything else over dp)."""

from __future__ import annotations

import pytest
import torch

from parity import tiny
from shardtrain.train.start.dryrun import dry_run

DEEPSEEK_LIKE = ("--model.dim", "512", "--model.n_layers", "3", "--model.n_heads", "8",
                 "--model.n_kv_heads", "0", "--model.vocab_size", "2048",
                 "--model.n_experts", "64", "--model.moe_top_k", "6", "--model.moe_ffn_dim", "128",
                 "--model.moe_shared_experts", "2", "--model.moe_first_dense", "1",
                 "--model.moe_groups", "8", "--model.moe_max_groups", "3",
                 "--model.moe_score", "sigmoid", "--model.moe_balance", "bias",
                 "--model.moe_aux_loss_coef", "0.0001", "--parallel.ep", "8",
                 "--train.global_batch", "64", "--train.micro_batch", "1", "--train.seq_len", "32",
                 "--train.steps", "2")


@pytest.mark.slow  # three dry runs of a 64-rank job, ~10 s each
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_model_states_equal_the_planner(tmp_path, capsys, zero):
    cfg = tiny(tmp_path, f"zero{zero}", *DEEPSEEK_LIKE, "--parallel.zero", str(zero))
    report = dry_run(cfg, 64, torch.device("cpu"))
    capsys.readouterr()
    measured, planned = report["measured"], report["planned_estimate"]
    for key in ("params", "grads", "master", "optimizer"):
        assert measured[key] == planned[key], (zero, key, measured[key], planned[key])
    assert measured["params"] > 0 and measured["optimizer"] > 0
