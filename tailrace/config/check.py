"""The one helper every section's `__post_init__` uses to reject a value."""

from __future__ import annotations

from tailrace.errors import ConfigError


def need(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`; `msg` names the key, its value and the fix, in one line."""
    if not ok:
        raise ConfigError(msg)
