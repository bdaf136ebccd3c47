"""Run in a fresh process by test_build_memory.py: build rank 0 of a 64-rank job for each
layout family over the fake process group and print, per layout, one JSON line with the
build's resident-memory growth, the planner's figures for the rank, and the model's
largest tensor (parallel/build.py says what a sharded build may hold).

A fresh process, because resident memory is a process-wide figure: the build's growth is
its peak (reset through /proc/self/clear_refs before it) less the memory in use before."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from shardtrain import config
from shardtrain.plan.layout import config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.train.start.dryrun import largest_tensor_bytes, rank0_trainer

WORLD = 64
# ~250M parameters (1 GB in fp32): the whole model stands far above any rank's share.
DENSE = ["--model.dim", "1024", "--model.n_layers", "16", "--model.n_heads", "16",
         "--model.n_kv_heads", "8", "--model.vocab_size", "32000", "--model.max_seq_len", "64"]
# ~180M parameters, 8 experts per layer: the experts are 3/4 of it.
MOE = ["--model.dim", "512", "--model.n_layers", "8", "--model.n_heads", "8",
       "--model.n_kv_heads", "8", "--model.vocab_size", "32000", "--model.max_seq_len", "64",
       "--model.n_experts", "8", "--model.moe_top_k", "2"]
LAYOUTS = {
    "zero3": DENSE + ["--parallel.zero", "3"],
    "tp": DENSE + ["--parallel.tp", "8"],
    "pp": DENSE + ["--parallel.pp", "8"],
    "ep": MOE + ["--parallel.ep", "8"],
}


def measure(name: str, cache_dir: str, run_dir: str) -> dict:
    cfg = config.load("tiny", LAYOUTS[name] + [
        "--data.cache_dir", cache_dir, "--train.run_dir", run_dir, "--train.peak_flops", "1e12",
        "--train.seq_len", "16",
        "--train.micro_batch", "1", "--train.global_batch", "64", "--train.steps", "1"])
    cfg.validate(WORLD)
    estimate = memory_per_gpu(cfg.model, config_layout(cfg, WORLD), seq_len=cfg.train.seq_len)
    with rank0_trainer(cfg, WORLD, torch.device("cpu")) as trainer:
        built = dict(trainer.build_memory)
        held = trainer.parallel.memory()
    del trainer
    gc.collect()
    return {"layout": name, "growth": built["build_peak_bytes"] - built["build_base_bytes"],
            "planned": {k: getattr(estimate, k) for k in ("params", "grads", "master", "optimizer")},
            "held": held, "largest": largest_tensor_bytes(cfg),
            "model": 4 * sum(p.numel() for p in _meta(cfg).parameters())}


def _meta(cfg):
    from shardtrain.model.transformer import build_model

    return build_model(cfg.model, seed=None)


if __name__ == "__main__":
    cache_dir, run_dir = sys.argv[1], sys.argv[2]
    for layout in sys.argv[3:]:
        print(json.dumps(measure(layout, cache_dir, str(Path(run_dir) / layout))), flush=True)
