"""Tokenizers read from files other libraries wrote: a Hugging Face tokenizer directory
(tokenizer.json + tokenizer_config.json: EOS, chat template), a SentencePiece
`.model`, and a tiktoken BPE ranks file (`.tiktoken`). Each encodes exactly as its own library
does (tests/test_tokenizers.py checks that); sentencepiece and tiktoken are optional
dependencies (`pip install 'shardtrain[tokenizer-files]'`), imported only when such a file is named.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardtrain.config import ConfigError
from shardtrain.data.tokenizer import EOS_TEXT, BPETokenizer, Tokenizer, concat_ids

# The pre-tokenization split of OpenAI's cl100k_base: a .tiktoken file holds only the ranks.
_TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def load_tokenizer_file(path: Path, given: str) -> Tokenizer:
    """The tokenizer at `path` (data.tokenizer = `given`), by its form."""
    if path.is_dir():
        return HFDirTokenizer(path, given)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={given!r}: no such file; give the path of an "
                          "existing SentencePiece .model or tiktoken .tiktoken file")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, given)
    return TiktokenTokenizer(path, given)


class HFDirTokenizer(BPETokenizer):
    """tokenizer.json with its tokenizer_config.json: EOS by name, and the chat template
    (`chat_template`, or None). BOS is added where tokenizer.json's post-processor adds it
    (Llama 3's), as transformers does, whatever the config's add_bos_token says."""

    def __init__(self, path: Path, given: str) -> None:
        tok_file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ConfigError(f"data.tokenizer={given!r}: the directory has no tokenizer.json; "
                              "give a directory written by a transformers tokenizer's "
                              "save_pretrained (tokenizer.json + tokenizer_config.json)")
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{config_file}: invalid JSON ({e.msg}); fix or remove "
                                  "it") from None
        super().__init__(tok_file, eos=_token(config.get("eos_token")))
        self.directory = path
        template = path / "chat_template.jinja"  # newer transformers write it beside the config
        self.chat_template: str | None = (template.read_text() if template.is_file()
                                          else config.get("chat_template"))
        self.name += "-" + hashlib.sha256(config_file.read_bytes() if config_file.is_file()
                                          else b"").hexdigest()[:8]


class SentencePieceTokenizer:
    """A SentencePiece model; EOS its `</s>` id (none when the model was trained without)."""

    path = None  # no tokenizer.json to copy into checkpoints: generate reads data.tokenizer

    def __init__(self, path: Path, given: str) -> None:
        spm = _optional("sentencepiece", given)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"data.tokenizer={given!r}: not a valid SentencePiece model "
                              f"({e})") from None
        self.vocab_size: int = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eos_id = eos if eos >= 0 else None
        # Its library's encode adds no BOS or EOS unless asked (add_bos, add_eos): none here.
        self.head: tuple[int, ...] = ()
        self.tail: tuple[int, ...] = ()
        self.name = "spm-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        return concat_ids(self.encode_each(texts))


class TiktokenTokenizer:
    """A tiktoken BPE ranks file (base64 token, rank per line) with cl100k's split pattern;
    EOS is `<|endoftext|>`, the id after the last rank."""

    path = None

    def __init__(self, path: Path, given: str) -> None:
        tiktoken = _optional("tiktoken", given)
        # Read here: tiktoken's own loader needs blobfile for local paths too.
        try:
            ranks = {base64.b64decode(token, validate=True): int(rank) for token, rank in
                     (line.split() for line in path.read_text().splitlines() if line)}
        except (ValueError, binascii.Error) as e:  # a malformed line
            raise ConfigError(f"data.tokenizer={given!r}: not a tiktoken BPE file ({e}); give "
                              "a file of 'base64-token rank' lines") from None
        if not ranks:
            raise ConfigError(f"data.tokenizer={given!r}: the tiktoken BPE file is empty")
        eos = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(name=path.stem, pat_str=_TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens={EOS_TEXT: eos})
        self.vocab_size: int = self._enc.n_vocab
        self.eos_id: int | None = eos
        self.head: tuple[int, ...] = ()
        self.tail: tuple[int, ...] = ()
        self.name = "tiktoken-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # special-token text in a corpus stays text

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def encode_each(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        return concat_ids(self.encode_each(texts))


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _optional(module: str, given: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"data.tokenizer={given!r} needs the {module} package: pip install "
                          "'shardtrain[tokenizer-files]'") from None
