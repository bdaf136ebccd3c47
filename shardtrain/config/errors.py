"""The configuration's one exception type."""


class ConfigError(ValueError):
    """A bad configuration: the message names the field and the fix."""
