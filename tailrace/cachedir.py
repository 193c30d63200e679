"""Where tailrace keeps what it builds once per machine: $TAILRACE_CACHE, default ~/.cache/tailrace."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TAILRACE_CACHE", Path.home() / ".cache" / "tailrace"))
