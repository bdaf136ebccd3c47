"""The end of a run gathers nothing (train/finetune/sample.py): the sample of a data-parallel run
(the default run's layout) comes from rank 0's own model, ZeRO-3's from every rank
generating in lockstep through its sharded model, tensor parallelism's from the final
checkpoint read on rank 0; `train.export_hf` streams that checkpoint. In every case no
full state dict is built: each way of building one is made to raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist import run_distributed
from parity import make_mesh, tiny
from shardtrain.parallel.pipeline import state
from shardtrain.parallel.tensor import sharding
from shardtrain.train.trainer import Trainer

# zero3-bf16: ZeRO-3 holds the weights autocast rounds in bf16, so the sample runs under the
# run's autocast too (it crashed at the end of such a run before).
LAYOUTS = {"dp2": [], "zero3": ["--parallel.zero", "3"], "tp2": ["--parallel.tp", "2"],
           "zero3-bf16": ["--parallel.zero", "3", "--train.precision", "bf16"]}


def _no_gathers(*args, **kwargs):
    raise AssertionError("a full state dict was built on the training path")


def _runs(rank: int, world_size: int, tmp: str) -> dict[str, str | None]:
    state.StageShards.full_state_dict = _no_gathers
    sharding.TensorShards.full_state_dict = _no_gathers
    state.all_gather_objects = _no_gathers
    samples = {}
    for name, overrides in LAYOUTS.items():
        cfg = tiny(Path(tmp), name, "--train.steps", "2", "--train.sample_tokens", "12",
                   "--train.export_hf", str(Path(tmp) / f"{name}-hf"), *overrides)
        trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
        samples[name] = trainer.run().sample
    return samples


def test_end_of_run_sample_and_export_gather_nothing(tmp_path):
    transformers = pytest.importorskip("transformers")
    results = run_distributed(_runs, 2, str(tmp_path))
    for name in LAYOUTS:
        assert results[0][name].startswith("def ") and len(results[0][name]) > len("def ")
        assert results[1][name] is None  # rank 0 alone decodes
        config = transformers.AutoConfig.from_pretrained(tmp_path / f"{name}-hf")
        assert config.num_hidden_layers == 2  # the streamed export is a model directory
