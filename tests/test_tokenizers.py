"""Tokenizer files of other libraries: each encodes and decodes as its own library does, and
its EOS (and BOS where its config asks) delimits documents in the token stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import load_dataset, load_tokenizer

TEXT = "def héllo(x):\n    return x * 2  # ☃ the quick brown fox\n"
CORPUS = [TEXT, "the lazy dog sleeps in the sun", "return the value of x to the caller"] * 30
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def cfg(tmp_path: Path, tokenizer: Path, **kw) -> DataConfig:
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in ["first doc", "second"] * 40))
    return DataConfig(source=str(src), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"),
                      eval_fraction=0.1, **kw)


def hf_dir(tmp_path: Path) -> Path:
    """A transformers tokenizer directory: byte-level BPE, <s>/</s>, BOS asked for, a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    out = tmp_path / "hf"
    fast.save_pretrained(str(out))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    return out


def test_hf_directory_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = hf_dir(tmp_path)
    ours, theirs = load_tokenizer(cfg(tmp_path, path)), AutoTokenizer.from_pretrained(str(path))
    ids = ours.encode(TEXT)
    assert ids == theirs(TEXT, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids) == TEXT
    assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.vocab_size == len(theirs) and ours.chat_template == CHAT_TEMPLATE
    # The config asks for BOS: every document is [BOS] ids EOS in the stream.
    ds = load_dataset(cfg(tmp_path, path), seq_len=4)
    stream = np.concatenate([ds.train, ds.eval]).tolist()
    doc = [ours.bos_id, *ours.encode("first doc"), ours.eos_id]
    assert stream[:len(doc)] == doc and stream.count(ours.bos_id) == 80


def test_sentencepiece_matches_its_library(tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(prefix),
                                   vocab_size=320, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    model = prefix.with_suffix(".model")
    ours = load_tokenizer(cfg(tmp_path, model))
    theirs = spm.SentencePieceProcessor(model_file=str(model))
    text = "the quick fox returns x ☃"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    assert ours.eos_id == theirs.eos_id() >= 0 and ours.vocab_size == theirs.get_piece_size()
    ds = load_dataset(cfg(tmp_path, model), seq_len=4)
    stream = np.concatenate([ds.train, ds.eval]).tolist()
    assert stream[:len(ours.encode("first doc")) + 1] == ours.encode("first doc") + [ours.eos_id]


def test_tiktoken_file_matches_its_library(tmp_path):
    import base64

    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    for merged in (b"th", b"the", b" the", b"re", b"ret", b"return"):  # each a merge of two
        ranks[merged] = len(ranks)
    path = tmp_path / "tiny.tiktoken"
    # tiktoken's format (its dump_tiktoken_bpe needs blobfile): "base64(token) rank" lines.
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    ours = load_tokenizer(cfg(tmp_path, path))
    from shardtrain.data.tokenizer_files import _TIKTOKEN_PATTERN

    theirs = tiktoken.Encoding("t", pat_str=_TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                               special_tokens={})
    assert ours.encode(TEXT) == theirs.encode(TEXT) and ours.decode(ours.encode(TEXT)) == TEXT
    assert ours.encode(" the")[0] == ranks[b" the"]  # the merges apply
    assert ours.eos_id == 262 and ours.vocab_size == 263
    assert ours.encode("<|endoftext|>") != [ours.eos_id]  # corpus text stays text


def test_tokenizer_file_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*empty.*no tokenizer\.json"):
        load_tokenizer(cfg(tmp_path, tmp_path / "empty"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*bad\.model.*not a valid Sentence"):
        load_tokenizer(cfg(tmp_path, bad))
