"""data.streaming: windows read and tokenized on the fly, the cached stream's windows in
order, layout-independent, and resumed exactly (sampler state and a checkpointed run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from parity import make_mesh, tiny
from shardtrain.config import ConfigError, DataConfig
from shardtrain.data.cache import load_tokens
from shardtrain.data.stream import StreamSampler
from shardtrain.data.tokenizer import ByteTokenizer
from shardtrain.train.trainer import Trainer


def source(tmp_path: Path, n: int = 60) -> Path:
    path = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)  # documents of 1 to 40 characters: windows cross them
    path.write_text("".join(json.dumps({"text": "ab☃cd"[:1] + "x" * int(rng.integers(0, 40))
                                        + str(i)}) + "\n" for i in range(n)))
    return path


def sampler(cfg: DataConfig, **kw) -> StreamSampler:
    args = dict(seq_len=8, global_batch=6, micro_batch=3, dp_rank=0, dp_size=1, seed=0)
    return StreamSampler(cfg, ByteTokenizer(), **{**args, **kw})


def rows(step) -> torch.Tensor:
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in step])  # [b, S + 1]


def test_windows_follow_the_stream_across_epochs_and_ranks(tmp_path):
    cfg = DataConfig(source=str(source(tmp_path)), cache_dir=str(tmp_path / "c"))
    tokens = np.asarray(load_tokens(cfg, ByteTokenizer()), dtype=np.int64)
    looped = np.concatenate([tokens] * 4)  # the stream goes on past the end, epoch 2, 3, ...
    single = sampler(cfg)
    ranks = [sampler(cfg, dp_rank=r, dp_size=2, micro_batch=1) for r in range(2)]
    n_steps = 3 * len(tokens) // (6 * 8)  # about three epochs
    for k in range(n_steps):
        want = rows(single.next_step())
        for i in range(6):
            start = (k * 6 + i) * 8
            assert want[i].tolist() == looped[start:start + 9].tolist(), (k, i)
        assert torch.equal(torch.cat([rows(r.next_step()) for r in ranks]), want)


def test_resume_is_exact_from_any_step(tmp_path):
    cfg = DataConfig(source=str(source(tmp_path)), cache_dir=str(tmp_path / "c"))
    run = sampler(cfg)
    states, steps = [], []
    for _ in range(40):  # past an epoch's end (about 1500 tokens, 48 a step)
        states.append(run.state_dict())
        steps.append(rows(run.next_step()))
    for k in (1, 7, 31, 33):
        resumed = sampler(cfg)
        resumed.load_state_dict(json.loads(json.dumps(states[k])))  # as a checkpoint holds it
        assert all(torch.equal(rows(resumed.next_step()), steps[j]) for j in range(k, k + 5))
    with pytest.raises(ValueError, match="global_batch was 6 in the checkpoint but is 12"):
        sampler(cfg, global_batch=12).load_state_dict(states[3])
    with pytest.raises(ConfigError, match="data.streaming=true .* needs data.eval_source"):
        DataConfig(source="x.jsonl", streaming=True).validate()


def test_a_streaming_run_resumes_to_the_same_losses(tmp_path):
    src = source(tmp_path, n=400)
    data = ["--data.source", str(src), "--data.streaming", "true", "--data.eval_source",
            str(src), "--checkpoint.every", "3"]

    def losses(name: str, *extra: str) -> list[float]:
        cfg = tiny(tmp_path, name, "--train.steps", "6", *data, *extra)
        return Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run().losses

    whole = losses("whole")
    first = tmp_path / "whole" / "checkpoints" / "step_00000003"
    assert first.is_dir()
    resumed = losses("resumed", "--checkpoint.resume", str(first))
    assert resumed == whole[3:]  # bit for bit
