"""Latent attention (model.attention = mla) in every layout that splits it: one process
against tp=2 with and without sp (heads split, latents whole: parallel/tensor/latent.py),
pp=2 (and with full recomputation), cp=2 ring (and Ulysses with selective recomputation: the swapped core sees the decompressed,
v-padded K/V), dp=2 x ZeRO-3, and a DeepSeek-like MoE (sigmoid scores, expert bias, a
shared expert, a dense first block, group-limited routing, routed scale) under ep=2 and
ep=2 x dp=2 x ZeRO-2; fp32 (losses rtol 1e-5, weights 1e-4) and bf16 (the bf16 loss
bounds)."""

from __future__ import annotations

import pytest

from shardtrain import config

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, tiny, train_layout, train_layouts,
                    worst_loss_deviation)

MLA = ("--model.attention", "mla", "--model.n_kv_heads", "0", "--model.q_lora_rank", "24",
       "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
       "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16", "--train.steps", "3")
MOE = ("--model.n_experts", "4", "--model.moe_ffn_dim", "32", "--model.moe_shared_experts",
       "1", "--model.moe_first_dense", "1", "--model.moe_score", "sigmoid",
       "--model.moe_balance", "bias", "--model.moe_aux_loss_coef", "0.001",
       "--model.moe_groups", "2", "--model.moe_max_groups", "1",
       "--model.moe_route_scale", "2.5")
BF16 = ("--train.precision", "bf16")
ROWS = [("tp2", ("--parallel.tp", "2")),
        ("tp2 sp", ("--parallel.tp", "2", "--parallel.sp", "true")),
        ("pp2", ("--parallel.pp", "2")), ("cp2", ("--parallel.cp", "2")),
        ("cp2 ulysses selective", ("--parallel.cp", "2", "--parallel.cp_mode", "ulysses",
                                   "--train.activation_checkpointing", "selective")),
        ("dp2 zero3", ("--parallel.zero", "3")),
        ("pp2 full", ("--parallel.pp", "2", "--train.activation_checkpointing", "full")),
        ("moe ep2", (*MOE, "--parallel.ep", "2"))]
ROWS += [(f"{label} bf16", (*o, *BF16)) for label, o in ROWS
         if label in ("tp2 sp", "pp2", "cp2", "dp2 zero3", "moe ep2")]


# ep=2 x dp=2 x ZeRO-2 on 4 ranks: the experts sharded over the expert-data-parallel group
WIDE = [("moe ep2 dp2 zero2", (*MOE, "--parallel.ep", "2", "--parallel.zero", "2"))]
WIDE += [(f"{WIDE[0][0]} bf16", (*WIDE[0][1], *BF16))]


@pytest.mark.slow  # a 2-rank spawn of 13 three-step runs, a 4-rank one of 2 (~30 s)
def test_mla_layouts_train_as_one_process(tmp_path):
    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *MLA, *o))  # noqa: E731
    refs = {(moe, bf16): train_layout(0, 1, text(f"ref{moe}{bf16}", *(MOE if moe else ()),
                                                 *(BF16 if bf16 else ())))
            for moe in (False, True) for bf16 in (False, True)}
    for world, rows in ((2, ROWS), (4, WIDE)):
        per_rank = run_distributed(train_layouts, world, [text(label.replace(" ", "-"), *o)
                                                          for label, o in rows])
        for i, (label, _) in enumerate(rows):
            ref = refs["moe" in label, "bf16" in label]
            for rank, results in enumerate(per_rank):
                got = results[i]
                if "bf16" in label:
                    worst = worst_loss_deviation(ref["losses"], got["losses"])
                    assert worst <= BF16_LOSS_RTOL["tp" in label], (label, rank, worst)
                else:
                    assert_parity(ref, got, f"{label} rank {rank}")
