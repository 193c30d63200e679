"""Error types shared across components (no dependencies, so any layer may raise them)."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix, in one line."""
