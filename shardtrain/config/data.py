"""The `[data]` section: sources (one, a mixture, a held-out set), the tokenizer, the token
cache and streaming (shardtrain/data/, docs/data.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shardtrain.config.errors import ConfigError, positive

# The label of a token that is not trained on (chat's prompts, padding): written by the data
# (data/rows.py), skipped by the losses (parallel/tensor/vocab.py). torch's ignore_index.
IGNORE = -100


@dataclass(kw_only=True)
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    # "stdlib", a text file, directory or glob, a .jsonl/.json/.csv/.parquet/.arrow file, a
    # save_to_disk directory or a directory of Parquet/Arrow shards (data/sources.py)
    source: str = "stdlib"
    # A mixture instead of `source`: "PATH=WEIGHT, PATH=WEIGHT, ..." (any source forms),
    # sampled by weight (data/mixture.py). In a TOML file also a list of tables,
    # [{path = "...", weight = 3}, ...], which config/parse.py turns into this string.
    sources: str = ""
    text_field: str = "text"  # the field (column) read from each record or row
    # "byte", "bpe" (trained locally), or the path of a tokenizer.json, a Hugging Face tokenizer
    # directory, a SentencePiece .model or a tiktoken .tiktoken file (data/tokenizer*.py)
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    max_bytes: int = 0  # read at most this many bytes of text (0: all of it)
    eval_fraction: float = 0.02  # tail of the token stream held out, without an eval_source
    eval_source: str = ""  # a held-out set of its own, any source form ("": eval_fraction)
    cache_dir: str = "~/.cache/shardtrain"
    num_proc: int = 0  # processes tokenizing a corpus of more than one batch (0: the cores)
    # How long a run waits for another process's build of a cache file (token cache, trained
    # BPE, chat rows) before it gives up with an error naming the lock file (data/fsutil.py)
    lock_timeout_s: float = 1800.0
    streaming: bool = False  # read and tokenize the source as training goes (data/stream.py)
    # text: documents of data.text_field. chat: conversations, rows whose data.messages_field
    # is a list of {role, content}, rendered by the tokenizer's chat template (data/chat.py)
    format: Literal["text", "chat"] = "text"
    messages_field: str = "messages"
    # chat: the loss on the assistant's tokens only (the other labels ignored); false: on
    # every token of the conversation
    assistant_only_loss: bool = True
    # Attention kept inside each document (a conversation under chat), positions restarting
    # per document. Without it, chat pads each conversation to a sequence of its own; with
    # it, conversations are packed, none crossing a sequence's end (data/chat_rows.py).
    document_mask: bool = False

    def validate(self) -> None:
        if not 0.0 < self.eval_fraction < 0.5:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must lie in (0, 0.5)")
        positive("data", self, "bpe_vocab_size")
        if self.max_bytes < 0:
            raise ConfigError("data.max_bytes must be >= 0 (0 reads everything)")
        if self.num_proc < 0:
            raise ConfigError("data.num_proc must be >= 0 (0: the cores available)")
        positive("data", self, "lock_timeout_s")
        if self.streaming and (self.sources or not self.eval_source):
            raise ConfigError("data.streaming=true reads one data.source in order: it needs "
                              "data.eval_source for the eval set (a stream has no tail to hold "
                              "out) and no data.sources mixture")
        if self.format == "chat" and self.streaming:
            raise ConfigError("data.format=chat with data.streaming=true: conversations are "
                              "rendered and packed into sequences before training; set "
                              "data.streaming=false")
        if self.format == "text" and not self.assistant_only_loss:
            raise ConfigError("data.assistant_only_loss=false applies to data.format=chat "
                              "only (text is trained on every token already): drop it, or "
                              "set data.format=chat")
        if self.sources and self.source != "stdlib":
            raise ConfigError(f"data.source={self.source!r} and data.sources={self.sources!r} "
                              "are both set; give one (data.sources for a mixture)")
        self.mixture()

    def mixture(self) -> list[tuple[str, float]]:
        """The training sources with their weights: data.sources parsed, or data.source
        alone with weight 1."""
        if not self.sources:
            return [(self.source, 1.0)]
        out = []
        for item in self.sources.split(","):
            path, sep, weight = item.strip().rpartition("=")
            try:
                value = float(weight)
            except ValueError:
                value = -1.0
            # inf passes `> 0` but makes every share nan or 0 (data/mixture.py): refused here.
            if not sep or not path or not value > 0 or not math.isfinite(value):
                raise ConfigError(f"data.sources={self.sources!r}: {item.strip()!r} is not "
                                  "PATH=WEIGHT with a finite weight > 0; write e.g. "
                                  "\"web.parquet=3, code=1\"")
            out.append((path.strip(), value))
        total = sum(w for _, w in out)
        if not math.isfinite(total):  # finite weights whose sum overflows: no share computes
            raise ConfigError(f"data.sources={self.sources!r}: the weights add up to {total}, "
                              "beyond the largest float, so their shares cannot be computed; "
                              "scale them down (only their ratios matter), e.g. \"a=3, b=1\"")
        return out

    def source_list(self) -> list[str]:
        """Every source the run reads (checked before launch)."""
        return [p for p, _ in self.mixture()] + ([self.eval_source] if self.eval_source else [])


def sources_text(tables: object) -> str:
    """data.sources given in TOML as a list of {path, weight} tables, in the string form."""
    fix = ('; write data.sources = [{path = "web.parquet", weight = 3}, {path = "code", '
           'weight = 1}] (or the string "web.parquet=3, code=1")')
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"data.sources={tables!r} is not a list of {{path, weight}} tables{fix}")
    items = []
    for i, table in enumerate(tables, 1):
        where = f"data.sources entry {i} ({table!r})"
        if not isinstance(table, dict) or set(table) != {"path", "weight"}:
            raise ConfigError(f"{where} must be a table of exactly path and weight{fix}")
        path, weight = table["path"], table["weight"]
        if not isinstance(path, str) or not path.strip() or "," in path:
            raise ConfigError(f"{where}: path must be a non-empty string without a comma "
                              f"(commas separate the sources){fix}")
        if (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0
                or not math.isfinite(weight)):
            raise ConfigError(f"{where}: weight must be a finite number > 0{fix}")
        items.append(f"{path}={weight!r}")
    return ", ".join(items)
