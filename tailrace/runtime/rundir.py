"""The run directory: config.yaml, metrics.jsonl, events.jsonl, journal.jsonl, checkpoints/.

Everything is append-only JSON lines, flushed as written, so a killed run keeps what it produced.
The journal is the scheduler's write-ahead log (groups opened, trajectories finished, discards);
`--resume` replays it on top of the last checkpoint so no finished trajectory is lost.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from tailrace.records import EvalRecord, Record, StepRecord, dumps, read_metrics


class RecordFile:
    """An append-only JSONL file of typed records (`tailrace.records`), a line per record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, record: Record) -> None:
        self._f.write(dumps(record) + "\n")

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def truncate_metrics(path: Path, keep: Callable[[StepRecord | EvalRecord], bool]) -> None:
    """Rewrite metrics.jsonl keeping only the records for which keep(record) is true (atomically)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if keep(r)]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.ckpt = self.path / "checkpoints"

    def create(self) -> None:
        self.ckpt.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    def latest(self) -> Path | None:
        link = self.ckpt / "latest"
        if not link.is_file():
            return None
        target = self.ckpt / link.read_text().strip()
        return target if target.is_dir() else None

    def set_latest(self, name: str, keep: int) -> None:
        """Point `latest` at a complete checkpoint, then delete all but the newest `keep`."""
        tmp = self.ckpt / "latest.tmp"
        tmp.write_text(name)
        os.replace(tmp, self.ckpt / "latest")
        done = sorted(p for p in self.ckpt.glob("step_*") if (p / "scheduler.json").is_file())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
