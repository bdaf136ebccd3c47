"""Documents out of resolved source parts (data/sources.py): text files and JSONL read here,
the tabular forms (JSON, CSV, Parquet, Arrow, save_to_disk directories) through `datasets`.

Tabular files are opened as streaming datasets: rows are read batch by batch from the local
files, nothing is copied into the `datasets` cache, and memory stays bounded whatever the
corpus size. `datasets` is imported only when such a source is read (a second of start-up
the default stdlib run does not pay).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtrain.config import ConfigError

if TYPE_CHECKING:
    from shardtrain.data.sources import Part

_ROWS = 1024  # rows per batch read from a table


def read_parts(parts: Iterable[Part], field: str, *, limit: int) -> Iterator[str]:
    """The non-empty documents of every part, in order. `limit` > 0 reads at most that many
    bytes of a text file (records and rows are read one by one, so callers stop early)."""
    for part in parts:
        if part.kind == "text":
            for path in part.paths:
                if text := _read_text(path, limit):
                    yield text
        elif part.kind == "jsonl":
            for path in part.paths:
                yield from _read_jsonl(path, field)
        else:
            yield from _read_table(part, field)


def decode(raw: bytes) -> str:
    # final=False drops a multi-byte character cut in half by truncation.
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)


def column(part: Part, field: str) -> Iterator[tuple[str, Any]]:
    """("file row i", the cell) of one column of a tabular part (chat reads its messages
    column here)."""
    where = _where(part)
    i = 0
    for batch in _batches(part, field, "data.messages_field"):
        for value in batch[field]:
            yield f"{where} row {i}", value
            i += 1


def _read_text(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        raw = f.read(limit) if limit else f.read()
    return decode(raw)


def records(path: Path) -> Iterator[tuple[str, Any]]:
    """("file:line", the parsed record) for each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: invalid JSON ({e.msg}); fix the line or the "
                                  "file given as data.source") from None


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    for where, record in records(path):
        if not isinstance(record, dict) or field not in record:
            raise ConfigError(f"{where}: the record has no field {field!r} (data.text_field); "
                              "set data.text_field to the field holding the text")
        text = record[field]
        if not isinstance(text, str):
            raise ConfigError(f"{where}: field {field!r} (data.text_field) is "
                              f"{type(text).__name__}, not a string")
        if text:
            yield text


def _read_table(part: Part, field: str) -> Iterator[str]:
    for batch in _batches(part, field):
        for text in batch[field]:
            if text is None:  # a null cell: no document
                continue
            if not isinstance(text, str):
                raise ConfigError(f"{_where(part)}: column {field!r} (data.text_field) holds "
                                  f"{type(text).__name__} values, not strings; set "
                                  "data.text_field to a text column")
            if text:
                yield text


def _batches(part: Part, field: str, setting: str = "data.text_field"
             ) -> Iterator[dict[str, list[Any]]]:
    """Column batches of a tabular part, `field` the only column read; `setting` is the
    config field that named it."""
    dataset = _open(part)
    columns = dataset.column_names
    if columns is not None and field not in columns:
        raise ConfigError(f"{_where(part)} has no column {field!r} ({setting}); its "
                          f"columns are {columns}: set {setting} to one of them")
    dataset = dataset.select_columns([field])
    try:
        yield from dataset.iter(batch_size=_ROWS)
    except (ValueError, KeyError) as e:  # a CSV's header is known only once it is read
        if field in str(e):
            raise ConfigError(f"{_where(part)} has no column {field!r} ({setting}); set "
                              f"{setting} to the right column") from None
        raise


def _open(part: Part) -> Any:
    """A `datasets` Dataset (save_to_disk directory, memory-mapped) or IterableDataset."""
    import datasets

    datasets.disable_progress_bars()  # tqdm bars per shard would bury the run's own output
    if part.kind == "saved":
        (path,) = part.paths
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"{path} is a DatasetDict without a 'train' split (splits: "
                                  f"{list(loaded)}); give the split's own directory")
            loaded = loaded["train"]
        return loaded
    files = [str(p) for p in part.paths]
    try:
        return datasets.load_dataset(part.kind, data_files=files, split="train", streaming=True)
    except Exception as e:  # datasets raises many kinds on a malformed file
        raise ConfigError(f"{_where(part)}: not a readable {part.kind} file ({e}); fix or "
                          "remove it") from None


def _where(part: Part) -> str:
    first = part.paths[0]
    return str(first) if len(part.paths) == 1 else f"{first} (and {len(part.paths) - 1} more)"
