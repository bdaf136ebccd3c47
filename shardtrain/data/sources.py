"""Where the training text comes from: the stdlib, files, directories, globs or JSONL."""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from shardtrain.config import ConfigError, DataConfig

_GLOB_CHARS = frozenset("*?[")
_SNIFF_BYTES = 8192  # a NUL byte in a file's head marks it binary
_FIX = "give 'stdlib', an existing text file, a directory of text files, or a matching glob"


def source_files(cfg: DataConfig) -> list[Path]:
    """The source's files, sorted; raises ConfigError when the path or glob matches none."""
    if cfg.source == "stdlib":
        return sorted(_stdlib_files(Path(sysconfig.get_paths()["stdlib"])))
    path = Path(os.path.expanduser(cfg.source))
    if path.is_file():
        return [path]  # named explicitly: taken as text whatever its content
    if path.is_dir():
        files = sorted(p for p in _walk(path) if _is_text(p))
        if not files:
            raise _error(cfg, "the directory holds no text files")
        return files
    if _GLOB_CHARS & set(cfg.source):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file() and _is_text(p)]
        if not files:
            raise _error(cfg, "the glob matches no text files")
        return files
    raise _error(cfg, "no such file or directory")


def _stdlib_files(root: Path) -> Iterator[Path]:
    """The *.py files under the stdlib's root, site-packages left out. site-packages is
    pruned from the walk, not filtered after it: it can hold tens of thousands of files,
    and every trainer lists the source (about a second per trainer when it was walked)."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        yield from (Path(folder, n) for n in names
                    if n.endswith(".py") and Path(folder, n).is_file())


def check_source(cfg: DataConfig) -> None:
    """Cheap pre-launch check that the source exists and holds some text."""
    if cfg.source == "stdlib":
        return
    files = source_files(cfg)
    for path in files:
        if any(_read(path, cfg.text_field, limit=_SNIFF_BYTES)):
            return
    raise _error(cfg, f"the {len(files)} file(s) hold no text (all empty)")


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Non-empty documents (one per text file or JSONL record), at most `max_bytes` in all."""
    remaining = cfg.max_bytes
    for path in source_files(cfg):
        # 3 spare bytes complete a character cut at the limit, so the cut below is exact.
        for text in _read(path, cfg.text_field, limit=remaining + 3 if remaining else 0):
            if cfg.max_bytes:
                raw = text.encode("utf-8")
                if len(raw) >= remaining:
                    yield _decode(raw[:remaining])
                    return
                remaining -= len(raw)
            yield text


def fingerprint(cfg: DataConfig) -> str:
    """sha256 of the file list (path, size, mtime) + max_bytes + text_field: the cache key."""
    stats = [(str(p), (s := p.stat()).st_size, s.st_mtime_ns) for p in source_files(cfg)]
    blob = json.dumps([stats, cfg.max_bytes, cfg.text_field])
    return hashlib.sha256(blob.encode()).hexdigest()


def _read(path: Path, field: str, *, limit: int) -> Iterator[str]:
    """The non-empty documents of one file; `limit` > 0 reads at most that many bytes of a
    text file (JSONL is read record by record, so callers stop it early)."""
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, field)
        return
    with open(path, "rb") as f:
        raw = f.read(limit) if limit else f.read()
    if text := _decode(raw):
        yield text


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: invalid JSON ({e.msg}); fix the line or the "
                                  "file given as data.source") from None
            if not isinstance(record, dict) or field not in record:
                raise ConfigError(f"{where}: the record has no field {field!r} (data.text_field); "
                                  "set data.text_field to the field holding the text")
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(f"{where}: field {field!r} (data.text_field) is "
                                  f"{type(text).__name__}, not a string")
            if text:
                yield text


def _decode(raw: bytes) -> str:
    # final=False drops a multi-byte character cut in half by truncation.
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)


def _walk(root: Path) -> Iterator[Path]:
    """Files under `root`, skipping hidden files and directories (.git and such)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                yield Path(dirpath) / name


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(_SNIFF_BYTES)


def _error(cfg: DataConfig, problem: str) -> ConfigError:
    return ConfigError(f"data.source={cfg.source!r}: {problem}; {_FIX}")
