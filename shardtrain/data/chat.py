"""Chat conversations (data.format = chat): read from a source, rendered by the tokenizer's
chat template, and the assistant's tokens found.

A conversation is a row whose `data.messages_field` (default `messages`) is a list of
{"role": ..., "content": ...} messages: a JSONL record, or a cell of a JSON, CSV, Parquet
or Arrow table (data/readers.py). It is rendered by `transformers`' `apply_chat_template`
with the template of the `data.tokenizer` directory (`chat_template` in its
tokenizer_config.json, or chat_template.jinja).

Which tokens are the assistant's:
- where the template marks the replies with {% generation %} ... {% endgeneration %},
  transformers' assistant-token mask (`return_assistant_tokens_mask`);
- else, by rendering prefixes: for assistant message i, the text of messages[:i] with the
  generation prompt ends where the reply begins, and the text of messages[:i+1] ends where
  its turn ends (its end-of-turn token included, so the model learns to stop). A token is
  the assistant's when its first character lies in such a span. A template whose renderings
  of a conversation's prefixes are not prefixes of its full rendering (one that rewrites
  earlier turns) is refused, naming the conversation: give it generation marks.

`transformers` is imported only here, and only for chat data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import readers, sources

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def tokenizer_dir(cfg: DataConfig) -> Path:
    """The Hugging Face tokenizer directory data.tokenizer names (itself, or a
    tokenizer.json's directory): the one form that carries a chat template."""
    path = Path(os.path.expanduser(cfg.tokenizer))
    if path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer_config.json").is_file():
        raise ConfigError(f"data.format=chat renders conversations with the tokenizer's chat "
                          f"template, but data.tokenizer={cfg.tokenizer!r} is not a Hugging Face "
                          "tokenizer directory (tokenizer.json + tokenizer_config.json); give "
                          "one whose config has a chat_template (model.init_from's directory "
                          "is used when it has one)")
    return path


def load_chat_tokenizer(cfg: DataConfig) -> Any:
    """The `transformers` tokenizer of data.tokenizer's directory, which has a template."""
    path = tokenizer_dir(cfg)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data.format=chat needs the transformers package for chat templates: "
                          "pip install 'shardtrain[chat]'") from None
    tok = AutoTokenizer.from_pretrained(str(path))
    if not tok.chat_template:
        raise ConfigError(f"data.format=chat: the tokenizer directory {path} has no chat "
                          "template (chat_template in tokenizer_config.json, or "
                          "chat_template.jinja); add one, or train on data.format=text")
    return tok


def render(tok: Any, messages: list[dict[str, str]], where: str
           ) -> tuple[list[int], list[bool]]:
    """A conversation's token ids and, for each, whether it is the assistant's."""
    if _GENERATION.search(tok.chat_template):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(f"{where}: the chat template renders this conversation's turns "
                              "differently from its prefixes, so the assistant's tokens cannot "
                              "be found; mark them in the template with {% generation %} ... "
                              "{% endgeneration %}")
        spans.append((len(before), len(through)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return (list(enc["input_ids"]),
            [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]])


def conversations(cfg: DataConfig, source: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where, messages) of every conversation of `source`, checked; at most
    data.max_bytes of message text (whole conversations; 0: all)."""
    field, total = cfg.messages_field, 0
    for part in sources.resolve(source):
        if part.kind == "text":
            raise ConfigError(f"data.format=chat reads records, but {part.paths[0]} is text; "
                              "give .jsonl/.json/.csv/.parquet/.arrow rows whose "
                              f"{field!r} (data.messages_field) is a list of messages")
        if part.kind == "jsonl":
            rows = ((where, record.get(field) if isinstance(record, dict) else None)
                    for path in part.paths for where, record in readers.records(path))
        else:
            rows = readers.column(part, field)
        for where, messages in rows:
            yield where, _checked(messages, where, field)
            total += sum(len(m["content"].encode("utf-8")) for m in messages)
            if cfg.max_bytes and total >= cfg.max_bytes:
                return


def _checked(messages: Any, where: str, field: str) -> list[dict[str, str]]:
    """The messages as plain dicts, or a ConfigError saying what the row holds instead."""
    fix = (f"{field!r} (data.messages_field) must be a list of {{\"role\": ..., \"content\": "
           "...}} messages with string values")
    if not isinstance(messages, list) or not messages:
        got = ("no such field" if messages is None else "an empty list" if messages == []
               else type(messages).__name__)
        raise ConfigError(f"{where}: {fix}; the row has {got}")
    out = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: {fix}, got the message {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_chat(cfg: DataConfig) -> None:
    """Before launch: the tokenizer has a template and each source's first conversation
    reads and renders."""
    tok = load_chat_tokenizer(cfg)
    for source in cfg.source_list():
        if source == "stdlib":
            raise ConfigError("data.format=chat needs conversations: set data.source to "
                              "records with a messages list (the default 'stdlib' is text)")
        for where, messages in conversations(cfg, source):
            render(tok, messages, where)
            break
        else:
            raise ConfigError(f"data.source={source!r} holds no conversations")
