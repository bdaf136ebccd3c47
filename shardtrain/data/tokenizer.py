"""Tokenizers: raw UTF-8 bytes, or byte-level BPE (trained here or loaded from tokenizer.json);
a Hugging Face tokenizer directory, SentencePiece and tiktoken files in data/tokenizer_files.py.

Every tokenizer says which id separates documents (`eos_id`) and which ids its own
post-processor puts around a text (`head`, `tail`: Llama 3's BOS before it): the token cache
frames each document so, and puts EOS between documents, so the model learns where a
document ends and sees the ids it was (or will be) trained on elsewhere.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import sources
from shardtrain.data.fsutil import build_once

EOS_TEXT = "<|endoftext|>"  # the EOS token a locally trained BPE gets
# Names an EOS token goes by in tokenizer.json files that come without a tokenizer_config.json.
_EOS_NAMES = (EOS_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class Tokenizer(Protocol):
    vocab_size: int
    name: str  # stable identity: equal names encode identically (part of cache keys)
    eos_id: int | None  # ends every document in the token stream (None: a newline does)
    # The ids the tokenizer's own post-processor puts before and after a text (tokenizers'
    # `encode(text)`, transformers' `tokenizer(text)`): Llama 3's head is its BOS; GPT-2's
    # and Qwen2.5's are empty. encode/encode_each leave them out.
    head: tuple[int, ...]
    tail: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids."""

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        """Each text encoded on its own, the ids concatenated (1-D integer array)."""


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt as a document starts in the token stream (`encode_documents`): the
    tokenizer's head (Llama 3's BOS), then the text; decode the reply past len(head)."""
    return [*tokenizer.head, *tokenizer.encode(text)]


def encode_documents(tokenizer: Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """The token stream of `docs`: each document as the tokenizer's post-processor frames it
    (head ids tail: exactly its library's ids with special tokens), then EOS, the separator,
    unless the tail already ends with it (no EOS twice); doc + "\\n" in place of EOS where
    the tokenizer has none (a tokenizer.json naming none of the usual EOS tokens)."""
    eos, head, tail = tokenizer.eos_id, tokenizer.head, tokenizer.tail
    if isinstance(tokenizer, ByteTokenizer):  # one join: bytes never merge across documents
        return np.frombuffer(b"".join(d.encode("utf-8") + _BYTE_EOS for d in docs), np.uint8)
    if eos is None:
        docs, end = [doc + "\n" for doc in docs], tail
    else:
        end = tail if tail[-1:] == (eos,) else (*tail, eos)
    if not head and not end:
        return tokenizer.encode_concat(docs)
    before, after = np.asarray(head, np.int64), np.asarray(end, np.int64)
    pieces: list[np.ndarray] = []
    for ids in tokenizer.encode_each(docs):
        pieces += [before, np.asarray(ids, np.int64), after]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


_BYTE_EOS = b"\xff"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train. EOS is byte 0xFF, which
    UTF-8 never produces (0xC0, 0xC1 and 0xF5-0xFF are invalid in it), so documents are
    delimited by an id of their own without growing the vocabulary (a vocabulary of 257
    would also break every tensor-parallel split of the embedding)."""

    vocab_size = 256
    name = "byte"
    eos_id: int | None = 0xFF
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return self.encode_concat([text]).tolist()

    def decode(self, ids: list[int]) -> str:
        # EOS is dropped (it is a boundary, not text); a cut character decodes, replaced.
        return bytes(i for i in ids if i != 0xFF).decode("utf-8", errors="replace")

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        # Bytes do not interact across a boundary, so one join encodes them all at once.
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)


class BPETokenizer:
    """A `tokenizers` tokenizer read from a tokenizer.json; named by the file's hash (and its
    EOS). `eos` names the EOS token (a tokenizer_config.json's); with none given, the first
    added special token with a usual EOS name is taken. Head and tail are its post-processor's
    (`_frame`)."""

    def __init__(self, path: Path, *, eos: str | None = None) -> None:
        self.path = path  # checkpoints carry a copy, so a model stays decodable on its own
        self._tok = HFTokenizer.from_file(str(path))
        # A corpus that spells "<|endoftext|>" holds text, not a boundary: special tokens are
        # inserted by encode_documents only, never matched in the text.
        self._tok.encode_special_tokens = True
        self.vocab_size: int = self._tok.get_vocab_size()
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        eos = eos or next((n for n in _EOS_NAMES if n in specials), None)
        self.eos_id = None if eos is None else self._tok.token_to_id(eos)
        self.head, self.tail = _frame(self._tok)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        # The frame is in the name: streams framed before it was read (Llama 3 files lost
        # their BOS) are not reused from the cache.
        self.name = f"bpe-{digest}-eos{self.eos_id}-head{list(self.head)}-tail{list(self.tail)}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        # Parallel in Rust; the _fast variant (tokenizers >= 0.20) skips the character
        # offsets nobody here reads: faster, and a batch's encodings take far less memory.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        return concat_ids(self.encode_each(texts))


def _frame(tok: HFTokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor puts before and after a text, read off the library's own
    encoding of one (whatever the post-processor: Llama 3's TemplateProcessing, BERT's,
    none); the ids it marks as no sequence's are the frame. tokenizer_config.json's
    add_bos_token is not asked: transformers (5) also encodes by the post-processor alone."""
    enc = tok.encode("a", add_special_tokens=True)
    inside = [i for i, s in enumerate(enc.sequence_ids) if s is not None]
    if not inside:  # the probe encoded to nothing: all the frame goes first
        return tuple(enc.ids), ()
    return tuple(enc.ids[:inside[0]]), tuple(enc.ids[inside[-1] + 1:])


def concat_ids(each: list[list[int]]) -> np.ndarray:
    """Texts' ids (encode_each) as one 1-D int64 array."""
    return np.concatenate([np.asarray(ids, dtype=np.int64) for ids in each]
                          or [np.zeros(0, dtype=np.int64)])


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """`data.tokenizer`: "byte", "bpe" (trained on the source, cached), a tokenizer.json, a
    Hugging Face tokenizer directory, a SentencePiece .model or a tiktoken BPE file."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return BPETokenizer(train_bpe(cfg))
    from shardtrain.data.tokenizer_files import load_tokenizer_file

    path = Path(os.path.expanduser(cfg.tokenizer))
    if path.is_dir() or path.suffix in (".model", ".tiktoken"):
        return load_tokenizer_file(path, cfg.tokenizer)
    if path.name == "tokenizer.json" and (path.parent / "tokenizer_config.json").is_file():
        # A Hugging Face directory's tokenizer.json (model.init_from names it): its config
        # says which tokens are EOS and BOS.
        return load_tokenizer_file(path.parent, cfg.tokenizer)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r}: no such file; give 'byte', 'bpe', "
                          "or the path of an existing tokenizer.json, Hugging Face tokenizer "
                          "directory, SentencePiece .model or tiktoken .tiktoken file")
    try:
        return BPETokenizer(path)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r}: not a valid tokenizer.json "
                          f"({e}); give a file saved by the `tokenizers` library") from None


def train_bpe(cfg: DataConfig) -> Path:
    """Train a byte-level BPE on the source once; the tokenizer.json path, keyed by the
    source fingerprint and vocabulary size under `data.cache_dir`."""
    # "eos": trained with its EOS token (tokenizers trained before it had none).
    paths = [path for path, _ in cfg.mixture()]  # a mixture's tokenizer learns every source
    key = f"eos:{'+'.join(sources.fingerprint(cfg, p) for p in paths)}:{cfg.bpe_vocab_size}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    target = Path(os.path.expanduser(cfg.cache_dir)) / f"bpe-{digest[:16]}" / "tokenizer.json"

    def build(tmp: Path) -> None:
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.bpe_vocab_size, show_progress=False, special_tokens=[EOS_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte stays encodable
        docs = (doc for p in paths for doc in sources.iter_documents(cfg, p))
        tok.train_from_iterator(docs, trainer)
        tok.save(str(tmp))

    build_once(target, build, timeout_s=cfg.lock_timeout_s)
    return target
