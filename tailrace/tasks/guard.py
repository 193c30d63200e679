"""RewardGuard: score responses with user reward code that may raise, hang or return garbage.

Every failure becomes reward 0 with a one-line reason, is counted in `errors` (by kind: "timeout",
"raised ValueError", "bad value", "worker died") and logged on "tailrace.tasks"; a finite reward
outside the task's `reward_range` is clamped into it (kind "clamped"). The run goes on.

Rewards run in one persistent worker process (forked where possible, so the task is not pickled;
under spawn it is pickled once per worker start). A batch is one message each way: the worker
flushes results early only when the batch has run for `timeout_s / 10`, so a hang loses (and
re-scores) at most that much finished work. The worker publishes (item, start time) in shared
memory before each item; the parent watches it, and kills and replaces a worker whose current item
has run `timeout_s`, then sends the rest of the batch to the new one. `inline=True` scores in the
calling process: exceptions are caught, hangs are not (for trusted tasks and tests).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from tailrace.tasks.base import Example, Task

log = logging.getLogger("tailrace.tasks")

_IDX, _T0 = 0, 1  # slots of the shared progress array
_WAITING = -1.0  # progress index while the worker has not started the batch
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str | None = None  # why the task's own score was replaced (by 0, or clamped); None if not


def _score_one(task: Task, example: Example, response: str) -> tuple[float, str | None]:
    try:
        value = task.reward(example, response)
    except BaseException as e:  # noqa: BLE001 — user code: SystemExit is a failure to score too
        msg = " ".join(str(e).split())[:200]
        return 0.0, f"raised {type(e).__name__}: {msg}" if msg else f"raised {type(e).__name__}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return 0.0, f"bad value: returned {type(value).__name__} {str(value)[:50]!r}, expected float"
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"bad value: {value}"
    return value, None


def error_kind(error: str) -> str:
    """The counter key of a reason: "timeout", "bad value", "worker died", "clamped" or "raised <Type>"."""
    for kind in ("timeout", "bad value", "worker died", "clamped"):
        if error.startswith(kind):
            return kind
    return error.split(":", 1)[0]


def _worker_main(task: Task, conn, progress, parent_pid: int, flush_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn.send("ready")
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:  # orphaned: the parent died without closing us
                return
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        out, flushed = [], time.monotonic()
        for i, (example, response) in enumerate(batch):
            now = time.monotonic()
            if out and now - flushed > flush_s:
                conn.send(out)
                out, flushed = [], now
            progress[_T0] = now  # time before index: a reader never pairs a new index with an old time
            progress[_IDX] = i
            out.append((i, *_score_one(task, example, response)))
        conn.send(out)


class RewardGuard:
    def __init__(
        self, task: Task, timeout_s: float = 5.0, *, inline: bool = False, start_method: str | None = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        lo, hi = task.reward_range
        if not lo < hi:
            raise ValueError(
                f"{task.name}: reward_range {task.reward_range} must be (low, high) with low < high"
            )
        self.task, self.timeout_s, self.inline = task, timeout_s, inline
        self.errors: Counter[str] = Counter()
        self.restarts = 0  # workers replaced after a hang or death
        if start_method is None:
            start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(start_method)
        self._proc = self._conn = None
        self._progress = self._ctx.RawArray("d", 2)
        if not inline:
            self._start()

    # -- public -------------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Scored:
        return self.score_many([(example, response)])[0]

    def score_many(self, pairs: Sequence[tuple[Example, str]]) -> list[Scored]:
        pairs = list(pairs)
        raw: list[tuple[float, str | None]] = [(0.0, None)] * len(pairs)
        if self.inline:
            raw = [_score_one(self.task, ex, resp) for ex, resp in pairs]
        else:
            pending = list(range(len(pairs)))
            while pending:
                pending = self._run(pairs, pending, raw)
        lo, hi = self.task.reward_range
        out = []
        for (ex, _), (reward, error) in zip(pairs, raw):
            if error is None and not lo <= reward <= hi:
                error = f"clamped: returned {reward:g}, outside the task's range [{lo:g}, {hi:g}]"
                reward = min(max(reward, lo), hi)
            if error is not None:
                self._record(ex, error, reward)
            out.append(Scored(reward, error))
        return out

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._proc.join(timeout=1.0)
        self._stop()

    def __enter__(self) -> RewardGuard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 — interpreter teardown
            pass

    # -- worker lifecycle ---------------------------------------------------------------------
    def _start(self) -> None:
        # a fresh pipe per worker: a killed worker may have left a half-written message in the old one
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_worker_main,
            name=f"reward-{self.task.name}",
            daemon=True,
            args=(self.task, child, self._progress, os.getpid(), self.timeout_s / 10),
        )
        self._proc.start()
        child.close()
        # wait for the worker to be up, so a slow start (spawn imports) never counts as a hang
        try:
            if self._conn.poll(_START_TIMEOUT_S) and self._conn.recv() == "ready":
                return
        except (EOFError, OSError):
            pass
        self._stop()
        raise RuntimeError(
            f"reward worker for {self.task.name} failed to start within "
            f"{_START_TIMEOUT_S}s (exit code {self._proc_exitcode}); under "
            f"start_method='spawn' the task must be picklable and importable"
        )

    def _stop(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._proc_exitcode = self._proc.exitcode
        self._conn.close()
        self._proc = self._conn = None

    def _replace(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def _run(self, pairs: list, pending: list[int], raw: list) -> list[int]:
        """Send `pending` (indices into pairs) as one batch and fill `raw` until it is done or its
        worker fails; then fail the current item, replace the worker and return the indices still
        unscored (those after it, and any finished but not yet flushed before it)."""
        self._progress[_T0], self._progress[_IDX] = time.monotonic(), _WAITING
        self._conn.send([pairs[i] for i in pending])
        left = set(range(len(pending)))
        while left:
            try:
                if self._conn.poll(self._wait_s()):
                    for i, reward, error in self._conn.recv():
                        raw[pending[i]] = (reward, error)
                        left.discard(i)
                    continue
                broken = False
            except (EOFError, OSError):
                broken = True  # the worker's end closed: it died
            failed = self._failure(broken)
            if failed is None:
                continue
            i = int(self._progress[_IDX])
            if i not in left:  # not started yet (or died just after an item): blame the next one
                i = min(left)
            raw[pending[i]] = (0.0, failed)
            left.discard(i)
            self._replace()
            return [pending[j] for j in sorted(left)]
        return []

    def _wait_s(self) -> float:
        return max(0.0, self._progress[_T0] + self.timeout_s - time.monotonic()) + 1e-3

    def _failure(self, pipe_broken: bool) -> str | None:
        """Why the current item failed, or None if it is still within its time."""
        if pipe_broken or not self._proc.is_alive():
            self._proc.join(timeout=1.0)
            return f"worker died (exit code {self._proc.exitcode})"
        t0 = self._progress[_T0]
        if time.monotonic() - t0 >= self.timeout_s:
            return f"timeout after {self.timeout_s}s"
        return None

    def _record(self, example: Example, error: str, reward: float) -> None:
        self.errors[error_kind(error)] += 1
        log.warning("reward of %s example %s forced to %g: %s", self.task.name, example.id, reward, error)
