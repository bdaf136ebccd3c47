"""Weighted mixtures of sources (data.sources): exact per-block shares, independent of the
data-parallel layout, resumable, and printed at the start of a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from parity import make_mesh, tiny
from shardtrain import config
from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import TokenSampler
from shardtrain.data.mixture import Mixture
from shardtrain.train.trainer import Trainer

SEQ = 4
# Three streams whose tokens say where they come from: stream s holds s*1000 + position.
STREAMS = [np.arange(n * SEQ + 1, dtype=np.int64) + 1000 * s for s, n in enumerate((50, 7, 30))]
WEIGHTS = (5.0, 2.0, 3.0)


def sampler(**kw) -> TokenSampler:
    args = dict(seq_len=SEQ, global_batch=40, micro_batch=4, dp_rank=0, dp_size=1, seed=3,
                weights=WEIGHTS)
    return TokenSampler(STREAMS, **{**args, **kw})


def sources_of(step: list) -> np.ndarray:
    return torch.cat([x[:, 0] for x, _ in step]).numpy() // 1000  # [sequences] stream ids


def test_shares_are_exact_per_block_and_windows_cover_each_stream():
    s = sampler()
    steps = [s.next_step() for _ in range(50)]  # 2000 sequences: two blocks of 1000
    src = np.concatenate([sources_of(st) for st in steps])
    for block in (src[:1000], src[1000:]):
        assert np.bincount(block, minlength=3).tolist() == [500, 200, 300]
    assert not np.array_equal(src[:1000], src[1000:])  # each block shuffled on its own
    firsts = torch.cat([x[:, 0] for st in steps for x, _ in st]).numpy()
    # Stream 1 has 7 windows: its first 7 sequences are one epoch, each window once.
    stream1 = firsts[src == 1] - 1000
    assert sorted(stream1[:7].tolist()) == [w * SEQ for w in range(7)]
    text = s.describe(["a.jsonl", "b.parquet", "saved"], steps=50)
    assert "50.0%  a.jsonl" in text and "20.0%  b.parquet" in text and "30.0%  saved" in text
    assert "(7 windows, 57.14 epochs over 50 steps)" in text


def test_layout_independent_and_resumable():
    single = sampler()
    ranks = [sampler(dp_rank=r, dp_size=4, micro_batch=2) for r in range(4)]
    for _ in range(30):  # crosses a block boundary (1000 sequences = 25 steps)
        want = torch.cat([x for x, _ in single.next_step()])
        assert torch.equal(torch.cat([x for r in ranks for x, _ in r.next_step()]), want)
    state = single.state_dict()
    expected = [single.next_step() for _ in range(3)]
    resumed = sampler()
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_step() for _ in range(3)]):
        assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    with pytest.raises(ValueError, match="quota was .* in the checkpoint"):
        sampler(weights=(1.0, 1.0, 1.0)).load_state_dict(state)


def test_mixture_as_a_toml_list_of_tables(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[data]\nsources = [{path = "a.jsonl", weight = 3}, '
                    '{path = "dir/b", weight = 0.5}]\n')
    cfg = config.load(str(path))
    assert cfg.data.mixture() == [("a.jsonl", 3.0), ("dir/b", 0.5)]
    assert config.loads(config.to_toml(cfg)).data.mixture() == cfg.data.mixture()
    path.write_text('[[data.sources]]\npath = "a.jsonl"\nweight = 1\n\n'
                    '[[data.sources]]\npath = "b"\nweight = 2\n')  # TOML's other spelling
    assert config.load(str(path)).data.mixture() == [("a.jsonl", 1.0), ("b", 2.0)]
    for bad, match in [('[{path = "a"}]', "entry 1 .* must be a table of exactly path and weight"),
                       ('[{path = "a", weight = 2}, {path = "b", weight = 0}]',
                        "entry 2 .*weight must be a finite number > 0"),
                       ('[{path = "a", weight = true}]', "weight must be a finite number > 0"),
                       ('[{path = "a", weight = inf}, {path = "b", weight = 1}]',
                        "entry 1 .*weight must be a finite number > 0"),
                       ('[{path = "a,b", weight = 1}]', "path must be a non-empty string "
                                                        "without a comma"),
                       ("[]", "is not a list of {path, weight} tables")]:
        path.write_text(f"[data]\nsources = {bad}\n")
        with pytest.raises(ConfigError, match=rf"mix.toml: data.sources.*{match}"):
            config.load(str(path))


def test_bad_mixtures():
    with pytest.raises(ValueError, match="weight 0.0001 of source 2 .* never be sampled"):
        Mixture([1.0, 0.0001], seed=0)
    with pytest.raises(ConfigError, match=r"'b.jsonl' is not PATH=WEIGHT"):
        DataConfig(sources="a.jsonl=1, b.jsonl").validate()
    with pytest.raises(ConfigError, match="data.source=.* and data.sources=.* are both set"):
        DataConfig(source="x.txt", sources="a.jsonl=1").validate()


@pytest.mark.parametrize("sources, match", [
    ("a=inf, b=1", r"'a=inf' is not PATH=WEIGHT with a finite weight > 0"),
    ("a=1, b=nan", r"'b=nan' is not PATH=WEIGHT with a finite weight > 0"),
    ("a=1e308, b=1e308", r"the weights add up to inf, beyond the largest float.*scale them"),
])
def test_non_finite_mixture_weights_are_refused_by_the_config(sources, match):
    with pytest.raises(ConfigError, match=rf"data.sources={sources!r}: {match}"):
        DataConfig(sources=sources).validate()


def test_bad_mixture_weights_are_refused_before_launch(tmp_path, capsys):
    """Exit 2 with one line and no run dir: the non-finite weight (config validation) and
    the weight too small to be sampled (the pre-launch source check) alike."""
    from shardtrain.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta " * 50)
    b.write_text("gamma delta " * 50)
    for weights, needle in [(("inf", "1"), "is not PATH=WEIGHT with a finite weight"),
                            (("1e308", "1e308"), "the weights add up to inf"),
                            (("1", "1e-9"), "would never be sampled")]:
        run = tmp_path / "run"
        assert main(["train", "--config", "tiny", "--train.run_dir", str(run), "--data.sources",
                     f"{a}={weights[0]}, {b}={weights[1]}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardtrain train: error: data.sources") and needle in err, err
        assert err.count("\n") == 1 and not run.exists()


def test_a_mixture_run_prints_its_shares(tmp_path, capsys):
    words = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]
    paths = []
    for i in range(2):
        path = tmp_path / f"s{i}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{w} {i} {k}"}) + "\n"
                                for k in range(300) for w in words))
        paths.append(path)
    cfg = tiny(tmp_path, "mix", "--train.steps", "2",
               "--data.sources", f"{paths[0]}=3, {paths[1]}=1")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    out = capsys.readouterr().out
    assert f"75.0%  {paths[0]}" in out and f"25.0%  {paths[1]}" in out
    losses = trainer.run().losses
    assert len(losses) == 2 and all(np.isfinite(losses))
