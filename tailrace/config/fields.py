"""What every section is made of: fields that carry their one-line meaning, and the check helper.

A field's meaning lives in its metadata (`setting`, `section`), the one source `--help` prints, so
the help cannot drift from the dataclasses; a test holds every field to having one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tailrace.common import ConfigError


def setting(default: Any, doc: str) -> Any:
    """A config key: its default and its one-line meaning."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def section(factory: Callable[[], Any], doc: str) -> Any:
    """A field built afresh for each config by `factory` (a section's class, or a mutable default)."""
    return dataclasses.field(default_factory=factory, metadata={"doc": doc})


def doc(f: dataclasses.Field) -> str:
    """The field's one-line meaning ("" if it was declared without one)."""
    return f.metadata.get("doc", "")


def need(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`; `msg` names the key, its value and the fix, in one line."""
    if not ok:
        raise ConfigError(msg)
