"""Typed configuration: one keyword-only dataclass per component, TOML presets, CLI overrides.

A run's configuration is a `Config` made of small sections (schema.py). It is read from a
TOML file or a preset packaged in `shardtrain/configs/`, then `--section.field VALUE` overrides are applied
(parse.py); both paths are strict: an unknown section or field is a `ConfigError` naming
it and listing the valid names. `validate(world_size)` checks the whole thing before any
process starts.
"""

from shardtrain.config.parse import (CONFIG_DIR, apply, explain_origin, field_help, load, loads,
                                     parse_overrides, preset_names, read_toml, resolve_preset,
                                     to_toml)
from shardtrain.config.schema import (SECTIONS, CheckpointConfig, CommConfig, Config,
                                      ConfigError, DataConfig, ModelConfig, OptimConfig,
                                      ParallelConfig, TrainConfig)

__all__ = ["CONFIG_DIR", "SECTIONS", "CheckpointConfig", "CommConfig", "Config", "ConfigError",
           "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "apply",
           "explain_origin", "field_help", "load", "loads", "parse_overrides", "preset_names", "read_toml", "resolve_preset",
           "to_toml"]
