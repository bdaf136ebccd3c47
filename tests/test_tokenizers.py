"""Tokenizer files of other libraries: each encodes and decodes as its own library does, and
its EOS (and BOS where its config asks) delimits documents in the token stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import load_dataset, load_tokenizer
from shardtrain.data.tokenizer import prompt_ids

TEXT = "def héllo(x):\n    return x * 2  # ☃ the quick brown fox\n"
CORPUS = [TEXT, "the lazy dog sleeps in the sun", "return the value of x to the caller"] * 30
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def cfg(tmp_path: Path, tokenizer: Path, chat: Path | None = None, **kw) -> DataConfig:
    """Text: 80 documents; or the conversations of `chat`."""
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in ["first doc", "second"] * 40))
    return DataConfig(source=str(chat or src), tokenizer=str(tokenizer),
                      cache_dir=str(tmp_path / "c"), eval_fraction=0.1, **kw)


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


def family_dir(tmp_path: Path, family: str) -> Path:
    """A tokenizer directory laid out as `family`'s published files are (a small byte-level
    BPE trained here: no hub): its special tokens, tokenizer.json post-processor and
    tokenizer_config.json conventions."""
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    specials, config, frame = {
        # BOS from the post-processor alone; the config has no add_bos_token.
        "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                   {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_CHAT,
                    "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
                   "<|begin_of_text|> $A"),
        # No BOS; EOS <|endoftext|> (base) or <|im_end|> (instruct).
        "qwen2.5": (QWEN_SPECIALS, {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                                    "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
                    None),
        "qwen2.5-instruct": (QWEN_SPECIALS, {"tokenizer_class": "Qwen2Tokenizer",
                                             "bos_token": None, "eos_token": "<|im_end|>",
                                             "pad_token": "<|endoftext|>"}, None),
        # bos = eos = <|endoftext|>, and no post-processor adds either.
        "gpt2": (["<|endoftext|>"], {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": False,
                                     "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
                 None),
        # A post-processor that appends EOS (OLMo's files do): EOS is not doubled.
        "eos-appending": (["<|endoftext|>", "<|padding|>"],
                          {"tokenizer_class": "PreTrainedTokenizerFast",
                           "eos_token": "<|endoftext|>"}, "$A <|endoftext|>"),
    }[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if family.startswith("qwen"):  # Qwen2's own split (transformers' Qwen2Tokenizer sets it)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    steps = [processors.ByteLevel(trim_offsets=False)]
    if frame:
        special = next(t for t in specials if t in frame)
        steps.append(processors.TemplateProcessing(
            single=frame, pair=f"{frame} {frame.replace('$A', '$B:1')}",
            special_tokens=[(special, tok.token_to_id(special))]))
    tok.post_processor = processors.Sequence(steps)
    out = tmp_path / family
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
              r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Llama 3's template starts with the BOS text: chat rows must not get a second one.
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
               "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen2.5-instruct", "gpt2",
                                    "eos-appending"])
def test_document_streams_match_tokenizers_and_transformers(tmp_path, family):
    """Each document of the token stream is what `tokenizers` and `transformers` encode it to,
    special tokens included (Llama 3's BOS from its post-processor), then EOS between
    documents, never twice."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = family_dir(tmp_path, family)
    library, theirs = Tokenizer.from_file(str(path / "tokenizer.json")), \
        AutoTokenizer.from_pretrained(str(path))
    ours = load_tokenizer(cfg(tmp_path, path))
    assert ours.eos_id == theirs.eos_token_id is not None
    assert ours.encode(TEXT) == library.encode(TEXT, add_special_tokens=False).ids \
        == theirs(TEXT, add_special_tokens=False)["input_ids"]
    expected = []
    for doc in ["first doc", "second"] * 40:  # cfg()'s corpus
        ids = library.encode(doc).ids
        assert ids == theirs(doc)["input_ids"]
        expected += ids if ids[-1] == ours.eos_id else [*ids, ours.eos_id]
    ds = load_dataset(cfg(tmp_path, path), seq_len=4)
    assert np.concatenate([ds.train, ds.eval]).tolist() == expected
    bos = theirs.bos_token_id
    # One EOS per document; Llama 3's BOS starts each (GPT-2's BOS is its EOS).
    assert expected.count(ours.eos_id) == 80
    assert ours.head == ((bos,) if family == "llama3" else ())
    assert ours.tail == ((ours.eos_id,) if family == "eos-appending" else ())
    # A prompt starts as a document does (generate, the end-of-run sample): Llama 3's BOS.
    assert prompt_ids(ours, "first doc") == library.encode("first doc").ids[:len(
        library.encode("first doc").ids) - len(ours.tail)]
    if bos is not None and bos != ours.eos_id:
        assert expected.count(bos) == (80 if family == "llama3" else 0)
    if family == "llama3":  # chat rows: the template's BOS once per conversation, no other
        messages = [{"role": "user", "content": "first doc"},
                    {"role": "assistant", "content": "second"}]
        chat = tmp_path / "chat.jsonl"
        chat.write_text((json.dumps({"messages": messages}) + "\n") * 20)
        rows = load_dataset(cfg(tmp_path, path, format="chat", chat=chat), seq_len=64).train
        text = theirs.apply_chat_template(messages, tokenize=False)
        want = theirs(text, add_special_tokens=False)["input_ids"]
        assert want[0] == bos and want.count(bos) == 1  # the template's own
        assert rows.table[0, 0, :len(want)].tolist() == want  # one conversation per row


def test_hf_directory_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = hf_dir(tmp_path)
    ours, theirs = load_tokenizer(cfg(tmp_path, path)), AutoTokenizer.from_pretrained(str(path))
    ids = ours.encode(TEXT)
    assert ids == theirs(TEXT, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids) == TEXT
    assert ours.eos_id == theirs.eos_token_id
    assert ours.vocab_size == len(theirs) and ours.chat_template == CHAT_TEMPLATE
    # The config says add_bos_token, but tokenizer.json has no post-processor adding one:
    # transformers adds none, and neither does the stream.
    assert ours.head == ours.tail == () and theirs("first doc")["input_ids"] == ours.encode(
        "first doc")
    ds = load_dataset(cfg(tmp_path, path), seq_len=4)
    stream = np.concatenate([ds.train, ds.eval]).tolist()
    assert stream[:len(ours.encode("first doc")) + 1] == ours.encode("first doc") + [ours.eos_id]
    assert theirs.bos_token_id not in stream


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
