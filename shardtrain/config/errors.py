"""The configuration's one exception type, and the check every section uses."""

from typing import Any


class ConfigError(ValueError):
    """A bad configuration: the message names the field and the fix."""


def positive(section: str, obj: Any, *names: str) -> None:
    """Each `section.name` must be > 0."""
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)} must be positive")
