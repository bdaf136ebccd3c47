"""The data pipeline: sources, tokenizers, the token cache, and the sampler's batch order."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import (TokenSampler, check_source, eval_batches, load_dataset,
                             load_tokenizer)
from shardtrain.data.cache import cache_path
from shardtrain.data.fsutil import build_once
from shardtrain.data.sources import iter_documents
from shardtrain.data.tokenizer import ByteTokenizer

TEXT = "def héllo(x):\n    return x * 2  # ☃\n"


def data_cfg(tmp_path: Path, source: Path | str, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- tokenizers


def test_byte_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == TEXT
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a cut character decodes, replaced


def test_bpe_train_reload_round_trip(tmp_path):
    src = write(tmp_path / "corpus.txt", TEXT * 40 + "class Foo:\n    pass\n" * 40)
    cfg = data_cfg(tmp_path, src, tokenizer="bpe", bpe_vocab_size=300)
    tok = load_tokenizer(cfg)
    assert 256 < tok.vocab_size <= 300
    text = "def foo(): return 'héllo ☃'\n\t"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(TEXT)) < len(TEXT.encode())  # merges were learned
    saved = list((tmp_path / "cache").glob("bpe-*/tokenizer.json"))
    assert len(saved) == 1
    assert load_tokenizer(cfg).name == tok.name  # reused, not retrained
    reloaded = load_tokenizer(data_cfg(tmp_path, src, tokenizer=str(saved[0])))
    assert reloaded.name == tok.name and reloaded.encode(text) == tok.encode(text)
    ds = load_dataset(cfg, seq_len=4)  # the document encoded, then the trained EOS token
    stream = np.concatenate([ds.train, ds.eval]).tolist()
    assert tok.decode(tok.encode("<|endoftext|>")) == "<|endoftext|>"  # text stays text
    assert stream == tok.encode(src.read_text()) + [tok.eos_id] and tok.eos_id not in stream[:-1]


def test_tokenizer_path_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"data\.tokenizer=.*{missing.name}.*no such file"):
        load_tokenizer(data_cfg(tmp_path, "stdlib", tokenizer=str(missing)))
    bad = write(tmp_path / "bad.json", "{not a tokenizer")
    with pytest.raises(ConfigError, match=rf"data\.tokenizer=.*{bad.name}.*not a valid"):
        load_tokenizer(data_cfg(tmp_path, "stdlib", tokenizer=str(bad)))


# ---------------------------------------------------------------------------- sources


def test_jsonl_source(tmp_path):
    src = tmp_path / "docs.jsonl"
    write(src, "\n".join(json.dumps(r) for r in
                         [{"body": "first doc"}, {"body": ""}, {"body": "second ☃"}]) + "\n")
    cfg = data_cfg(tmp_path, src, text_field="body")
    check_source(cfg)
    assert list(iter_documents(cfg)) == ["first doc", "second ☃"]
    with pytest.raises(ConfigError, match=rf"{src.name}:1: .*'text'.*data\.text_field"):
        list(iter_documents(data_cfg(tmp_path, src)))


def test_max_bytes_truncates(tmp_path):
    write(tmp_path / "d/a.txt", "aaaa")
    write(tmp_path / "d/b.txt", "b☃bbbb")
    cfg = data_cfg(tmp_path, tmp_path / "d", max_bytes=6)
    assert list(iter_documents(cfg)) == ["aaaa", "b"]  # the snowman is cut, not half-kept


def test_directory_and_glob_sources(tmp_path):
    write(tmp_path / "d/z.txt", "zz")
    write(tmp_path / "d/sub/a.txt", "aa")
    write(tmp_path / "d/.git/config", "hidden")
    (tmp_path / "d/blob.bin").write_bytes(b"\x00\x01binary")
    assert list(iter_documents(data_cfg(tmp_path, tmp_path / "d"))) == ["aa", "zz"]
    glob_cfg = data_cfg(tmp_path, tmp_path / "d/**/*.txt")
    check_source(glob_cfg)
    assert list(iter_documents(glob_cfg)) == ["aa", "zz"]


@pytest.mark.parametrize("case, problem", [
    ("missing", "no such file or directory"),
    ("glob", "the glob matches no text files"),
    ("emptydir", "the directory holds no text files"),
    ("emptyfiles", "hold no text"),
])
def test_check_source_errors(tmp_path, case, problem):
    source = {"missing": tmp_path / "absent.txt", "glob": tmp_path / "*.none",
              "emptydir": tmp_path / "empty", "emptyfiles": tmp_path / "blank"}[case]
    (tmp_path / "empty").mkdir()
    write(tmp_path / "blank/a.txt", "")
    with pytest.raises(ConfigError) as err:
        check_source(data_cfg(tmp_path, source))
    message = str(err.value)
    assert "data.source=" in message and str(source) in message and problem in message
    assert "give 'stdlib'" in message  # the fix


def test_stdlib_source_small(tmp_path):
    cfg = data_cfg(tmp_path, "stdlib", max_bytes=3000)
    check_source(cfg)
    text = "".join(iter_documents(cfg))
    assert 2990 < len(text.encode()) <= 3000 and text.strip()


# ---------------------------------------------------------------------------- cache and dataset


def test_cache_built_once_and_rebuilt_on_change(tmp_path, monkeypatch):
    src = write(tmp_path / "d/a.txt", "abc" * 200)
    write(tmp_path / "d/b.txt", "xyz" * 200)
    cfg = data_cfg(tmp_path, tmp_path / "d", eval_fraction=0.1)
    ds = load_dataset(cfg, seq_len=8)
    stream = np.concatenate([ds.train, ds.eval])
    assert isinstance(ds.train, np.memmap) and stream.dtype == np.uint16
    # Each document ends with the byte tokenizer's EOS, 0xFF: a byte UTF-8 never produces.
    assert bytes(stream.tolist()) == b"abc" * 200 + b"\xff" + b"xyz" * 200 + b"\xff"
    assert len(ds.eval) == int(len(stream) * 0.1)
    path = cache_path(cfg, ds.tokenizer)

    def no_encoding(self, texts):
        raise AssertionError("re-tokenized although the cache is valid")

    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode_concat", no_encoding)
        again = load_dataset(cfg, seq_len=8)
    assert np.array_equal(np.concatenate([again.train, again.eval]), stream)

    write(src, "changed")
    changed = load_dataset(cfg, seq_len=8)
    assert cache_path(cfg, changed.tokenizer) != path
    assert bytes(np.concatenate([changed.train, changed.eval]).tolist()) == \
        b"changed\xff" + b"xyz" * 200 + b"\xff"


def test_build_once_under_concurrency(tmp_path):
    builds = []

    def build(tmp: Path) -> None:
        builds.append(tmp)
        time.sleep(0.05)  # hold the lock while the others arrive
        tmp.write_text("done")

    target = tmp_path / "shared" / "file.bin"
    with ThreadPoolExecutor(4) as pool:  # flock excludes separate opens, threads included
        built = list(pool.map(lambda _: build_once(target, build, timeout_s=60), range(4)))
    assert built.count(True) == 1 and len(builds) == 1
    assert target.read_text() == "done" and not list(target.parent.glob("*.tmp"))
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # the mode open() gives, not 0600


def test_too_few_tokens(tmp_path):
    cfg = data_cfg(tmp_path, write(tmp_path / "a.txt", "x" * 50), eval_fraction=0.1)
    with pytest.raises(ConfigError, match=r"51 tokens: 46 for training and 5 for eval.* = 17"):
        load_dataset(cfg, seq_len=16)


# ---------------------------------------------------------------------------- sampler


def sampler(tokens: np.ndarray, **kw) -> TokenSampler:
    args = dict(seq_len=4, global_batch=8, micro_batch=2, dp_rank=0, dp_size=1, seed=7)
    return TokenSampler(tokens, **{**args, **kw})


TOKENS = np.arange(4 * 13 + 1, dtype=np.uint16)  # 13 windows: epochs end mid-batch


def test_windows_and_targets():
    (inputs, targets), *_ = sampler(TOKENS).next_step()
    assert inputs.shape == targets.shape == (2, 4) and inputs.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert (inputs[:, 0] % 4 == 0).all()  # windows start on the stride


def test_dp_ranks_partition_the_global_batch():
    single = sampler(TOKENS)
    ranks = [sampler(TOKENS, dp_rank=r, dp_size=2, micro_batch=1) for r in range(2)]
    for _ in range(5):
        expected = torch.cat([x for x, _ in single.next_step()])  # [8, 4]
        got = torch.cat([x for r in ranks for x, _ in r.next_step()])
        assert torch.equal(got, expected)


def test_epochs_wrap_deterministically():
    s = sampler(TOKENS, global_batch=13, micro_batch=13)
    epochs = [s.next_step()[0][0][:, 0] // 4 for _ in range(3)]  # window ids, one epoch each
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(13))
    assert not torch.equal(epochs[0], epochs[1])
    again = sampler(TOKENS, global_batch=13, micro_batch=13)
    assert torch.equal(again.next_step()[0][0][:, 0] // 4, epochs[0])


def test_resume_from_state_dict():
    s = sampler(TOKENS)
    for _ in range(3):
        s.next_step()
    state = s.state_dict()
    expected = [s.next_step() for _ in range(3)]
    resumed = sampler(TOKENS)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_step() for _ in range(3)]):
        assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    with pytest.raises(ValueError, match="global_batch was 8 in the checkpoint but is 4"):
        sampler(TOKENS, global_batch=4).load_state_dict(state)


def test_bad_geometry():
    with pytest.raises(ValueError, match="global_batch=8 is not divisible"):
        sampler(TOKENS, micro_batch=3)
    with pytest.raises(ValueError, match="no window"):
        sampler(TOKENS[:4])


def test_eval_batches():
    batches = eval_batches(TOKENS, seq_len=4, batch_size=3, n_batches=2)
    assert len(batches) == 2 and all(x.shape == (3, 4) for x, _ in batches)
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert starts[0] == 0 and starts[-1] == len(TOKENS) - 5  # spread from first to last window
    assert all(torch.equal(a, b) for (a, _), (b, _) in
               zip(batches, eval_batches(TOKENS, seq_len=4, batch_size=3, n_batches=2)))
