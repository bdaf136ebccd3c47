"""The sharded build (parallel/build.py): rank 0 of a 64-rank job holds its share while it
is built, never the whole model. For each layout family -- ZeRO-3, tensor, pipeline and
expert parallelism -- a model of 180-250M parameters (0.7-1 GB in fp32) is built over the
fake process group in a fresh process (tests/build_memory.py), and the build's growth in
resident memory must stay within what the planner says the rank holds once built, plus the
one full tensor drawn at a time, plus a stated margin. The states that exist once built:
parameters, gradients (the reducers' buffers are allocated up front), master weights, and
ZeRO's optimizer shards (a torch optimizer builds its state at the first step). Building
the whole model, or a whole stage before slicing it, exceeds the bound in every row.

And once built: the vocabulary-sized units hand their gradient to the reduce-scatter
uncopied (at the step's peak, a copy would hold the model's largest gradient twice)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parity import tiny_data
from shardtrain.cli import main
from shardtrain.model.transformer import build_model

MARGIN = 64 << 20  # allocator and interpreter slack of a build, bytes
HERE = Path(__file__).parent


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_build_holds_the_ranks_share_not_the_model(tmp_path):
    cache = tiny_data(tmp_path)[1]
    run = subprocess.run([sys.executable, str(HERE / "build_memory.py"), cache, str(tmp_path),
                          "zero3", "tp", "pp", "ep"], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["layout"] for r in rows] == ["zero3", "tp", "pp", "ep"]
    for r in rows:
        planned = r["planned"]
        held = planned["params"] + planned["grads"] + planned["master"]
        if r["layout"] == "zero3":
            held += planned["optimizer"]
        bound = held + r["largest"] + MARGIN
        print(f"{r['layout']}: build added {r['growth'] / 2**20:.0f} MiB; bound "
              f"{bound / 2**20:.0f} MiB; the whole model {r['model'] / 2**20:.0f} MiB")
        assert r["growth"] <= bound, r
        assert bound < r["model"], r  # the bound would catch a whole-model build


@pytest.mark.parametrize("args", [
    [],  # one process holding all of Llama-3-8B: 120 GiB planned
    ["--dry-run-world", "8", "--parallel.zero", "1"],  # rank 0 of 8 under ZeRO-1: 45 GiB
])
def test_a_layout_that_cannot_fit_is_refused_before_building(tmp_path, capsys, args):
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "llama3-8b", "--train.seq_len", "64",
                 "--train.micro_batch", "1", "--train.global_batch", "8",
                 "--train.run_dir", str(run_dir), *args])
    err = capsys.readouterr().err
    assert code == 2 and "the planner puts each rank at" in err and "GiB" in err, err
    assert "params" in err and "train.memory_check false" in err
    assert not run_dir.exists()  # refused before anything was written


def test_vocabulary_units_hand_their_gradient_over_uncopied():
    """The untied embedding and the head are units of one parameter (the final norm joins
    the last block's, cost/units.py), and stage 2/3's reducer reduce-scatters their .grad
    as it is, where a unit of several parameters is copied into one flat gradient: a copy
    would hold the vocabulary-sized gradient twice at the step's peak."""
    from shardtrain.config import ModelConfig
    from shardtrain.parallel.zero.reducer import ZeroReducer
    from shardtrain.parallel.zero.units import UnitComm, build_units

    class Recording(UnitComm):  # one rank: the reduce-scatter keeps the whole gradient
        def __init__(self):
            super().__init__(None)
            self.reduced: set[int] = set()  # the buffers reduce-scattered

        def reduce_grads(self, shard, full, *, async_op=True):
            self.reduced.add(full.data_ptr())
            shard.copy_(full)
            return Done()

    class Done:
        def wait(self) -> None:
            pass

    cfg = ModelConfig(vocab_size=96, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      max_seq_len=8, tie_embeddings=False)
    model = build_model(cfg, seed=0)
    comm = Recording()
    units = build_units(model, dp_size=1, dp_rank=0, dtype=torch.float32, tied=False, comm=comm)
    assert [u.names for u in units][0] == ["tok_emb.weight"]
    assert units[-1].names == ["head.weight"] and units[-2].names[-1] == "norm.weight"
    grads: dict[str, int] = {}
    for name in ("tok_emb.weight", "head.weight", "norm.weight"):  # hooks before the reducer's
        p = model.get_parameter(name)
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.data_ptr()))
    reducer = ZeroReducer(units, stage=2, gatherer=None)  # no buckets: each unit alone
    reducer.zero_grad()
    F.cross_entropy(model(torch.randint(0, 96, (2, 8))).flatten(0, 1),
                    torch.randint(0, 96, (16,))).backward()
    reducer.finish()
    assert grads["tok_emb.weight"] in comm.reduced and grads["head.weight"] in comm.reduced
    assert grads["norm.weight"] not in comm.reduced  # several: copied
    assert all(u.grad_shard is not None and u.grad_shard.abs().sum() > 0 for u in units)
