"""Where the training text comes from: the stdlib, text files, directories, globs, JSONL, or
the tabular forms the `datasets` library reads (JSON, CSV, Parquet, Arrow, a `save_to_disk`
directory, a directory of Parquet/Arrow shards). Everything is local: no hub at run time.

A source resolves to `Part`s, runs of files of one kind read in order (data/readers.py
reads them); the resolution is what the pre-launch check, the cache key and the reader share.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import readers

_GLOB_CHARS = frozenset("*?[")
_SNIFF_BYTES = 8192  # a NUL byte in a file's head marks it binary
# File kinds by suffix; anything else is text when its head holds no NUL byte.
_SUFFIX_KIND = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                ".arrow": "arrow"}
_SHARD_KINDS = ("parquet", "arrow")
SUPPORTED = ("'stdlib', a text file, a directory of text files, a glob, a .jsonl/.json/.csv/"
             ".parquet/.arrow file, a directory written by datasets' save_to_disk, or a "
             "directory of .parquet/.arrow shards")
_FIX = f"give {SUPPORTED}"


@dataclass(frozen=True)
class Part:
    """Files of one kind, read in this order. kind: text, jsonl, json, csv, parquet, arrow,
    or saved (then `paths` is the one save_to_disk directory)."""

    kind: str
    paths: tuple[Path, ...]


def resolve(source: str) -> list[Part]:
    """The source's parts; raises ConfigError naming the source when it matches nothing, is a
    file of no supported format, or is not a local path (a hub dataset name)."""
    if source == "stdlib":
        return [Part("text", _stdlib_files())]
    path = Path(os.path.expanduser(source))
    if path.is_file():
        kind = _file_kind(path)
        if kind is None:
            raise _error(source, f"{path} is a binary file of no supported format "
                                 "(neither text nor .jsonl, .json, .csv, .parquet, .arrow)")
        return [Part(kind, (path,))]
    if path.is_dir():
        if _is_saved(path):
            return [Part("saved", (path,))]
        files = sorted(_walk(path))
        shards = [p for p in files if _SUFFIX_KIND.get(p.suffix) in _SHARD_KINDS]
        # A directory of Parquet/Arrow shards (a README or license beside them is not data);
        # else a directory of text, where only .jsonl is read by record (as before: a
        # project's .json or .csv files are text there, not tables).
        parts = _group(shards) if shards else _group(files, text_dir=True)
        if not parts:
            raise _error(source, "the directory holds no text files")
        return parts
    if _GLOB_CHARS & set(source):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        parts = _group([p for p in matches if p.is_file()])
        if not parts:
            raise _error(source, "the glob matches no text files")
        return parts
    if not path.is_absolute() and not source.startswith("."):
        raise _error(source, "no such file or directory, and shardtrain has no hub access at "
                             "run time: load the dataset where the hub is reachable, write it "
                             "with Dataset.save_to_disk (or to_parquet), and give that local path")
    raise _error(source, "no such file or directory")


def source_files(source: str) -> list[Path]:
    """Every file the source reads (a saved dataset: its directory's files), sorted per part."""
    out: list[Path] = []
    for part in resolve(source):
        for p in part.paths:
            out.extend(sorted(_walk(p)) if part.kind == "saved" else [p])
    return out


def check_source(cfg: DataConfig) -> None:
    """Cheap pre-launch check: the source resolves, its columns hold `data.text_field`, and
    it yields some text (chat: data/chat.py's check); a mixture's every source gets a share."""
    if cfg.sources:  # a weight too small ever to be sampled: refused here, not at step 0
        from shardtrain.data.mixture import Mixture

        Mixture([w for _, w in cfg.mixture()], seed=0)
    if cfg.format == "chat":
        from shardtrain.data.chat import check_chat  # chat imports this module

        check_chat(cfg)
        return
    for source in cfg.source_list():
        if source == "stdlib":
            continue
        parts = resolve(source)
        if any(True for _ in readers.read_parts(parts, cfg.text_field, limit=_SNIFF_BYTES)):
            continue
        raise _error(source, f"the {sum(len(p.paths) for p in parts)} file(s) hold no text "
                             "(all empty)")


def iter_documents(cfg: DataConfig, source: str | None = None) -> Iterator[str]:
    """Non-empty documents of `source` (default data.source), at most `max_bytes` in all:
    one per text file, one per JSONL record or table row."""
    parts = resolve(cfg.source if source is None else source)
    remaining = cfg.max_bytes
    # 3 spare bytes complete a character cut at the limit, so the cut below is exact.
    for text in readers.read_parts(parts, cfg.text_field, limit=remaining + 3 if remaining else 0):
        if cfg.max_bytes:
            raw = text.encode("utf-8")
            if len(raw) >= remaining:
                yield readers.decode(raw[:remaining])
                return
            remaining -= len(raw)
        yield text


def fingerprint(cfg: DataConfig, source: str | None = None) -> str:
    """sha256 of the file list (path, size, mtime) + max_bytes + text_field: the cache key."""
    files = source_files(cfg.source if source is None else source)
    stats = [(str(p), (s := p.stat()).st_size, s.st_mtime_ns) for p in files]
    blob = json.dumps([stats, cfg.max_bytes, cfg.text_field])
    return hashlib.sha256(blob.encode()).hexdigest()


@functools.cache  # the interpreter's own files: fixed while it runs, listed once
def _stdlib_files() -> tuple[Path, ...]:
    """The *.py files under the stdlib's root, sorted, site-packages left out. site-packages
    is pruned from the walk, not filtered after it: it can hold tens of thousands of files,
    and every trainer lists the source (about a second per trainer when it was walked)."""
    root, files = Path(sysconfig.get_paths()["stdlib"]), []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(folder, n) for n in names
                  if n.endswith(".py") and Path(folder, n).is_file()]
    return tuple(sorted(files))


def _file_kind(path: Path) -> str | None:
    """The reader for a file: by suffix, else text when its head holds no NUL byte, else
    None (a binary file no reader understands)."""
    if path.suffix in _SUFFIX_KIND:
        return _SUFFIX_KIND[path.suffix]
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if head.startswith(b"PAR1"):  # Parquet's magic, whatever the file is called
        return "parquet"
    return None if b"\0" in head else "text"


def _group(files: list[Path], *, text_dir: bool = False) -> list[Part]:
    """Consecutive files of one kind as one part; binary files of no known kind skipped (a
    directory or glob may hold them beside the text)."""
    parts: list[Part] = []
    for path in files:
        kind = _file_kind(path)
        if text_dir and kind not in (None, "jsonl"):
            kind = None if kind in _SHARD_KINDS else "text"
        if kind is None:
            continue
        if parts and parts[-1].kind == kind:
            parts[-1] = Part(kind, parts[-1].paths + (path,))
        else:
            parts.append(Part(kind, (path,)))
    return parts


def _is_saved(path: Path) -> bool:
    """A directory written by Dataset.save_to_disk (or DatasetDict.save_to_disk)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _walk(root: Path) -> Iterator[Path]:
    """Files under `root`, skipping hidden files and directories (.git and such)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                yield Path(dirpath) / name


def _error(source: str, problem: str) -> ConfigError:
    return ConfigError(f"data.source={source!r}: {problem}; {_FIX}")
