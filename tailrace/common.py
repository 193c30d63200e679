"""The few things every layer may use: the user-error type and the per-machine cache directory.
No dependencies, so the engine, the simulator, the config and the CLI all import it."""

from __future__ import annotations

import os
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix, in one line."""


def cache_root() -> Path:
    """Where tailrace keeps what it builds once per machine (the warm-started model, the C kernels,
    calibrated simulator presets): $TAILRACE_CACHE, default ~/.cache/tailrace."""
    return Path(os.environ.get("TAILRACE_CACHE", Path.home() / ".cache" / "tailrace"))
