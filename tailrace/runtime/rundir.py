"""The run directory: config.yaml, metrics.jsonl, events.jsonl, journal.jsonl, checkpoints/.

Everything is append-only JSON lines, flushed as written, so a killed run keeps what it produced.
The journal is the scheduler's write-ahead log (groups opened, trajectories finished, discards);
`--resume` replays it on top of the last checkpoint so no finished trajectory is lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from tailrace.common import ConfigError
from tailrace.records import Metric, Record, dumps, parse_line, read_metrics


class RecordFile:
    """An append-only JSONL file of typed records (`tailrace.records`), a line per record. Before a
    resume appends to an existing file, `repair` it."""

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


@dataclass(frozen=True)
class Repair:
    """What `repair` did to one file."""

    path: Path
    torn: bool = False  # a torn last line was cut off
    quarantined: tuple[int, ...] = ()  # line numbers moved to <file>.quarantine

    def message(self) -> str:
        """One line for the user ("" when the file needed nothing)."""
        done = []
        if self.quarantined:
            n = self.quarantined
            which = ", ".join(map(str, n[:5])) + (f" ... ({len(n)} in all)" if len(n) > 5 else "")
            done.append(
                f"moved damaged line{'s' if len(n) > 1 else ''} {which} to {self.path.name}.quarantine"
            )
        if self.torn:
            done.append("cut off a torn last line (a write the crash cut short)")
        return f"{self.path}: {'; '.join(done)}" if done else ""


def repair(path: Path) -> Repair:
    """Make a JSONL file safe to append to: cut off a torn last line (no newline; a whole record
    missing only its newline gets it back), and move each damaged line (not a JSON object) to
    <file>.quarantine as {"line", "text"}, leaving a blank line in its place so positions — the
    journal's sequence numbers — stay put. A sound file is not touched."""
    if not path.is_file():
        return Repair(path)
    damaged, tail, end = [], None, 0  # end: bytes up to the last newline
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):  # only the last line can lack its newline
                tail = raw
                break
            end += len(raw)
            if raw.strip() and parse_line(raw) is None:
                damaged.append((n, raw))
    torn = tail is not None and parse_line(tail) is None
    if tail is not None and not torn:
        with open(path, "ab") as f:
            f.write(b"\n")
    if damaged:
        _quarantine(path, damaged)
        _rewrite(path, {n for n, _ in damaged}, keep_tail=not torn)
    elif torn:
        os.truncate(path, end)
    return Repair(path, torn, tuple(n for n, _ in damaged))


def cut_from(path: Path, line: int) -> int:
    """Move the lines of `path` from `line` (1-based) on to <file>.quarantine and cut them off; returns
    how many lines the file had."""
    with open(path, "rb") as f:
        lines = f.readlines()
    _quarantine(path, enumerate(lines[line - 1 :], line))
    os.truncate(path, sum(len(raw) for raw in lines[: line - 1]))
    return len(lines)


def _rewrite(path: Path, bad: set[int], keep_tail: bool) -> None:
    """`path` with a blank line for each line number in `bad` (and without its torn tail)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for n, raw in enumerate(src, 1):
            if not raw.endswith(b"\n") and not keep_tail:
                break
            dst.write(b"\n" if n in bad else raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


def _quarantine(path: Path, lines: Iterable[tuple[int, bytes]]) -> None:
    """Append lines (number, bytes) to <file>.quarantine as {"line", "text"}; blank ones (a damaged line
    quarantined before) are skipped."""
    with open(path.with_name(path.name + ".quarantine"), "a") as q:
        for n, raw in lines:
            if raw.strip():
                q.write(json.dumps({"line": n, "text": raw.rstrip(b"\n").decode("utf-8", "replace")}) + "\n")


def truncate_metrics(path: Path, keep: Callable[[Metric], bool]) -> None:
    """Rewrite metrics.jsonl keeping only the records for which keep(record) is true (atomically)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if keep(r)]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


class RunDir:
    RECORDS = ("metrics.jsonl", "events.jsonl", "journal.jsonl")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.ckpt = self.path / "checkpoints"

    def file(self, name: str) -> Path:
        return self.path / name

    def holds_run(self) -> bool:
        """Whether a run has produced anything here (a start that failed before that has not)."""
        return any(self.file(f).exists() for f in self.RECORDS) or (
            self.ckpt.is_dir() and any(self.ckpt.iterdir())
        )

    def create(self) -> None:
        """Make the directory of a new run: a missing or empty one, or one a failed start left."""
        if self.holds_run():
            raise self._taken()
        try:
            self.ckpt.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create the run directory {self.path} ({e.strerror}); pass a writable --run-dir"
            ) from None

    def begin(self, config: str) -> None:
        """Write config.yaml; under the run's lock, so of two runs started here at once one is refused."""
        if self.holds_run():
            raise self._taken()
        self.file("config.yaml").write_text(config)

    def _taken(self) -> ConfigError:
        return ConfigError(
            f"--run-dir {self.path} already holds a run; continue it with tailrace train --resume "
            f"{self.path}, or pass another --run-dir"
        )


def policy_dirs(run: Path) -> list[Path]:
    """A run of several policies: each policy's run directory (policies/<name>/); a run of one: none."""
    root = Path(run) / "policies"
    if (Path(run) / "metrics.jsonl").exists() or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir())


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories by step, newest first (whole or not: see `checkpoint.verify`). Torch-free,
    so the supervisor reads them too."""
    return sorted((p for p in root.glob("step_*") if p.is_dir() and "." not in p.name), reverse=True)


def extended(run: Path) -> bool:
    """`tailrace train --resume RUN --flow.steps=N` (or `--flow.time_limit_s=S`) raised the run's steps or
    its time limit: its config.yaml asks for more than its newest checkpoint was written under, so a final
    evaluation recorded before is not the run's end. Reads YAML only (no torch: the supervisor asks too)."""
    from tailrace.config import load_config

    newest = step_dirs(Path(run) / "checkpoints")
    try:
        now = load_config(Path(run) / "config.yaml").flow
        then = load_config(newest[0] / "config.yaml").flow if newest else None
    except (ConfigError, OSError):
        return False  # the resume's own checks say what is wrong
    if then is None:
        return False
    limit, was = now.time_limit_s, then.time_limit_s
    return now.steps > then.steps or (was is not None and (limit is None or limit > was))
