"""Reading and writing configurations: TOML files and presets, `--section.field VALUE`
overrides, strict type coercion, and the resolved config back as TOML."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import tomllib
import types
import typing
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from shardtrain.config.data import sources_text
from shardtrain.config.schema import SECTIONS, Config, ConfigError

# The presets ship inside the package (package data, pyproject.toml) and are read through
# importlib.resources: a regular (non-editable) install has no source tree beside it.
CONFIG_DIR: Traversable = resources.files("shardtrain") / "configs"


def preset_names() -> list[str]:
    """The preset names `--config` accepts (configs/*.toml inside the package)."""
    return sorted(q.name[:-len(".toml")] for q in CONFIG_DIR.iterdir()
                  if q.name.endswith(".toml"))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a TOML or command-line value to the field's declared type, strictly."""
    origin = get_origin(annotation)
    if origin is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"{where}: union types are not used in configs")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}={value!r} is not a boolean (true or false)")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a number")
        try:
            number = annotation(value) if isinstance(value, str) else value
        except ValueError:
            raise ConfigError(f"{where}={value!r} is not a valid {annotation.__name__}") from None
        if annotation is int and (not isinstance(number, int) and not float(number).is_integer()):
            raise ConfigError(f"{where}={value!r} must be a whole number")
        if annotation is float and not math.isfinite(float(number)):
            raise ConfigError(f"{where}={value!r} is not a finite number; give a finite value")
        return annotation(number)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    raise TypeError(f"{where}: unsupported config type {annotation}")


def _unknown(kind: str, name: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {kind} {name!r}{hint} (valid: {', '.join(valid)})")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's field types, resolved once (get_type_hints re-evaluates every annotation
    on each call: most of a config load's time, and the planner loads configs by the
    thousand)."""
    return typing.get_type_hints(cls)


def apply(cfg: Config, section: str, name: str, value: Any) -> None:
    """Set `section.name = value` with type checking; unknown names are errors."""
    if section not in SECTIONS:
        raise _unknown("config section", section, list(SECTIONS))
    obj = getattr(cfg, section)
    hints = _hints(type(obj))
    if name not in hints:
        raise _unknown(f"field in [{section}]", name, list(hints))
    setattr(obj, name, _coerce(value, hints[name], f"{section}.{name}"))


def load(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file or a packaged preset (by name) and apply `--a.b VALUE` overrides."""
    cfg = Config()
    origins: dict[str, str] = {}
    if path is not None:
        preset = resolve_preset(path)
        source = str(path) if Path(path).exists() else f"preset {str(path)!r} ({preset})"
        for key in _apply_tables(cfg, read_toml(preset), source):
            origins[key] = source
    for key, value in parse_overrides(overrides or []):
        section, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"override --{key} must name a field as --section.field")
        apply(cfg, section, name, value)
        origins.pop(key, None)
    # Where each value not given on the command line came from: a later error about a
    # value the user never typed (a preset's) can then say so (`explain_origin`).
    cfg.origins = origins  # type: ignore[attr-defined]  (not a field: never written out)
    return cfg


def explain_origin(error: ConfigError, cfg: Config) -> ConfigError:
    """`error` with, for the first `section.field` it names that a file or preset set
    (not the command line), where that value came from and how to override it."""
    origins: dict[str, str] = getattr(cfg, "origins", {})
    for key in re.findall(r"\b([a-z_]+\.[a-z_0-9]+)\b", str(error)):
        if key in origins:
            return ConfigError(f"{error} ({key} came from {origins[key]}, not from the command "
                               f"line: override it with --{key} VALUE, or use a config file "
                               "that does not set it)")
    return error


def _apply_tables(cfg: Config, tables: dict[str, Any], where: str) -> list[str]:
    """Apply every `[section] name = value`; returns the "section.name" keys set."""
    keys = []
    for section, values in tables.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: top-level key {section!r} must be a [section] table")
        for name, value in values.items():
            try:
                if (section, name) == ("data", "sources") and not isinstance(value, str):
                    value = sources_text(value)  # the one list a config file may hold
                apply(cfg, section, name, value)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
            keys.append(f"{section}.{name}")
    return keys


def loads(text: str) -> Config:
    """A Config from TOML text (the inverse of `to_toml`)."""
    cfg = Config()
    _apply_tables(cfg, tomllib.loads(text), "config text")
    return cfg


def resolve_preset(path: str | os.PathLike) -> Path | Traversable:
    """A TOML file's path, or the packaged preset of that name."""
    p = Path(path)
    if p.exists():
        return p
    preset = CONFIG_DIR / f"{path}.toml"
    if preset.is_file():
        return preset
    raise ConfigError(f"config file {str(path)!r} does not exist; give a path to a TOML file or "
                      f"one of the presets: {', '.join(preset_names())}")


def read_toml(path: Path | Traversable) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b VALUE` or `--a.b=VALUE` pairs; anything else is an error naming it."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like "
                              "--section.field VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out.append((key, value))
    return out


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML (read back by `load` to an equal Config)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for name, value in values.items():
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def field_help() -> list[str]:
    """One line per field, `--section.field (type, default)`: the CLI's override list."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(f"  --{section}.{f.name} (default {default!r})")
    return out
