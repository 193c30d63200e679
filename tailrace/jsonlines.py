"""Reading JSONL record files (metrics, events, journal) written by runs and the simulator; torch-free,
so the simulator and the runtime share it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_lines(path: str | Path) -> Iterator[dict]:
    """Records of a JSONL file; a torn last line (killed mid-write) ends the file. A missing file has none."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                return
