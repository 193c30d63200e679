"""RewardGuard: score responses with user reward code that may raise, hang, misbehave or attack.

Every failure becomes reward 0 with a one-line reason, is counted in `errors` (by kind: "timeout",
"raised ValueError", "bad value", "worker died", "leaked processes") and logged on "tailrace.tasks";
a finite reward outside the task's `reward_range` is clamped into it (kind "clamped"). The run goes on.

Rewards run in one persistent worker process, sandboxed before it runs any of them (tasks/sandbox:
limits, a private directory, no network, a file-system allow-list; the package doc says what holds
on which system). It is forked where that is safe (`default_start_method`: no other thread runs, no
Ray session), so the task is not pickled; otherwise it is spawned (or as the task's
`reward_start_method` says) and the task is pickled once per worker start; a task that does not pickle
is forked anyway outside Ray, as before. A batch
is one message each way: the worker flushes results early only when the batch has run for
`timeout_s / 10`, so a hang loses (and re-scores) at most that much finished work. The worker
publishes (item, start time) in shared memory before each item; the parent watches it, and kills and
replaces a worker whose current item has run `timeout_s` (or whose batch has run `timeout_s` per
item: the worker's numbers are not trusted), then sends the rest of the batch to the new one. A
reward that returns while processes it started still run scores 0 ("leaked processes") and its
worker is replaced. Killing a worker kills its whole process group, which every process it started
stays in. Results come back as checked JSON, never pickle: the worker runs untrusted code, so what
it sends is data. `inline=True` scores in the calling process, unsandboxed: exceptions are caught,
hangs are not (for trusted tasks and tests).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import numbers
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from tailrace.tasks.base import Example, Task
from tailrace.tasks.sandbox import Held, SandboxConfig, enter, leaked_children
from tailrace.tasks.sandbox.isolated import may_fork, ray_session_up
from tailrace.tasks.sandbox.limits import CpuBudget

log = logging.getLogger("tailrace.tasks")

_IDX, _T0 = 0, 1  # slots of the shared progress array
_WAITING = -1.0  # progress index while the worker has not started the batch
_START_TIMEOUT_S = 120.0
_WORKDIR = "tailrace-reward-"  # a worker's directory: <tmp>/tailrace-reward-<the guard's pid>-<random>
_REASON_CHARS = 300  # a reason's length; a result row is at most 4 bytes a character of it and its numbers
_ROW_BYTES = 4 * _REASON_CHARS + 64
_LEAKED = "leaked processes: the reward returned with processes it started still running"


@dataclass(frozen=True)
class Scored:
    reward: float
    error: str | None = None  # why the task's own score was replaced (by 0, or clamped); None if not
    parts: tuple[float, ...] = ()  # a list of reward functions (task.reward): each one's value


def _score_one(task: Task, example: Example, response: str) -> tuple[float, str | None, tuple[float, ...]]:
    """The reward, why it was replaced (None: it was not), and with a list of functions (`part_fns`:
    tasks/user_reward.UserRewards) each one's value, one that failed counting 0 with its reason."""
    fns = getattr(task, "part_fns", None)
    if fns is None:
        return (*_call(task.reward, example, response), ())
    got = [_call(fn, example, response) for fn in fns]
    parts = tuple(v for v, _ in got)
    return task.combine(parts), next((e for _, e in got if e is not None), None), parts


def _call(reward, example: Example, response: str) -> tuple[float, str | None]:
    try:
        value = reward(example, response)
    except BaseException as e:  # noqa: BLE001 — user code: SystemExit is a failure to score too
        msg = " ".join(str(e).split())[:200]
        kind = type(e).__name__[:50]
        return 0.0, f"raised {kind}: {msg}" if msg else f"raised {kind}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return 0.0, f"bad value: returned {type(value).__name__} {str(value)[:50]!r}, expected float"
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"bad value: {value}"
    return value, None


def error_kind(error: str) -> str:
    """The counter key of a reason: "timeout", "bad value", "worker died", "leaked processes",
    "clamped" or "raised <Type>"."""
    for kind in ("timeout", "bad value", "worker died", "leaked processes", "clamped"):
        if error.startswith(kind):
            return kind
    return error.split(":", 1)[0]


def _worker_main(
    task: Task, cfg: SandboxConfig, workdir: str, conn, progress, parent_pid: int, flush_s: float
):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    held = enter(cfg, workdir, keep_fds=(conn.fileno(),))
    conn.send_bytes(json.dumps([held.mechanisms, held.notes, held.landlock_abi]).encode())
    cpu = CpuBudget(cfg.cpu_s)
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:  # orphaned: the parent died without closing us
                os.killpg(0, signal.SIGKILL)  # this worker and anything it left
        try:
            batch = conn.recv()  # pickle from the parent, which is trusted
        except (EOFError, OSError):
            return
        if batch is None:
            return
        out, flushed = [], time.monotonic()
        for i, (example, response) in enumerate(batch):
            now = time.monotonic()
            if out and now - flushed > flush_s:
                conn.send_bytes(_encode(out))
                out, flushed = [], now
            progress[_T0] = now  # time before index: a reader never pairs a new index with an old time
            progress[_IDX] = i
            cpu.arm()
            reward, error, parts = _score_one(task, example, response)
            leaked = leaked_children()
            out.append((i, 0.0, _LEAKED, ()) if leaked else (i, reward, error, parts))
            if leaked:
                break  # the parent kills this worker's group and sends the rest to a new one
        conn.send_bytes(_encode(out))


Row = tuple[int, float, "str | None", tuple[float, ...]]  # index, reward, reason, each function's value


def _encode(rows: list[Row]) -> bytes:
    return json.dumps(
        [(i, r, e if e is None else e[:_REASON_CHARS], p) for i, r, e, p in rows], ensure_ascii=False
    ).encode()


def _decode(data: bytes, n: int, parts_n: int = 0) -> list[Row]:
    """A worker's results, checked: ValueError (or the TypeError, OverflowError or RecursionError of
    a deeper malformation) unless every row is (index < n, finite reward, reason or None, none or
    `parts_n` finite parts)."""
    out = []
    for row in json.loads(data):
        i, reward, error, parts = row
        ok = type(i) is int and 0 <= i < n and _finite(reward) and isinstance(parts, list)
        ok = ok and len(parts) in (0, parts_n)
        if not ok or not (error is None or isinstance(error, str)) or not all(map(_finite, parts)):
            raise ValueError(f"malformed result {str(row)[:80]}")
        error = None if error is None else error[:_REASON_CHARS]
        out.append((i, float(reward), error, tuple(map(float, parts))))
    return out


def _finite(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def sweep_orphans() -> int:
    """Remove the reward workers' directories that a killed process left (its pid is in the name and
    no longer runs; under root the sandbox owns them, as a throwaway uid). Another user's stay: /tmp's
    sticky bit keeps them. Returns how many went."""
    gone, tmp = 0, tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(_WORKDIR)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(tmp, name)
        try:
            pid = int(name[len(_WORKDIR) :].split("-", 1)[0])
            os.kill(pid, 0)  # raises when no process has that pid
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            gone += 1
        except (ValueError, OSError):  # not ours, or a pid that runs (or one we may not signal)
            continue
    return gone


def default_start_method() -> str:
    """How a reward worker starts when neither the caller nor the task says: fork (nothing is pickled,
    nothing imported) where the platform has it and this process may fork (`may_fork`); spawn
    otherwise. A process with a Ray session up may not: gRPC's threads run in it, and a child forked
    then can crash before its first line (CI saw exit code -11). Nor one with another Python thread
    running (a run's join desk, its tool threads, when a worker is replaced mid-run): a lock that
    thread held at the fork would stay held in the child, which could hang before it ever answered.
    Spawn forks and execs at once, from C. Asked at each start: threads and sessions come and go."""
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    return "fork" if may_fork() else "spawn"


def _pickles(task: Task) -> bool:
    try:
        pickle.dumps(task)
    except Exception:  # noqa: BLE001 — whatever pickling a user's object raises
        return False
    return True


class RewardGuard:
    def __init__(
        self,
        task: Task,
        timeout_s: float = 5.0,
        *,
        inline: bool = False,
        start_method: str | None = None,
        sandbox: SandboxConfig = SandboxConfig(),
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        lo, hi = task.reward_range
        if not lo < hi:
            raise ValueError(
                f"{task.name}: reward_range {task.reward_range} must be (low, high) with low < high"
            )
        if not inline and not sys.platform.startswith("linux"):
            raise RuntimeError(
                f"the reward sandbox needs Linux, not {sys.platform}; pass inline=True to score "
                f"trusted reward code unsandboxed"
            )
        self.task, self.timeout_s, self.inline, self.sandbox = task, timeout_s, inline, sandbox
        self._parts = len(getattr(task, "part_fns", ()))  # a list of reward functions: how many (else 0)
        self._row_bytes = _ROW_BYTES + 32 * self._parts  # a float's JSON, 32 at most
        self.errors: Counter[str] = Counter()
        self.restarts = 0  # workers replaced after a hang, death or leak
        self.held: Held | None = None  # what the worker's sandbox holds; None inline
        self._start_method = start_method or task.reward_start_method  # None: chosen at each start
        self._proc = self._conn = self._workdir = None
        self._t_sent = self._batch_deadline = 0.0  # when the current batch was sent, and its last chance
        self._progress = mp.RawArray("d", 2)
        if not inline:
            self._start()

    # -- public -------------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Scored:
        return self.score_many([(example, response)])[0]

    def score_many(self, pairs: Sequence[tuple[Example, str]]) -> list[Scored]:
        pairs = list(pairs)
        raw: list[tuple[float, str | None, tuple[float, ...]]] = [(0.0, None, ())] * len(pairs)
        if self.inline:
            raw = [_score_one(self.task, ex, resp) for ex, resp in pairs]
        else:
            pending = list(range(len(pairs)))
            while pending:
                pending = self._run(pairs, pending, raw)
        lo, hi = self.task.reward_range
        out = []
        none = (0.0,) * self._parts  # an item that failed as a whole
        for (ex, _), (reward, error, parts) in zip(pairs, raw):
            if error is None and not lo <= reward <= hi:
                error = f"clamped: returned {reward:g}, outside the task's range [{lo:g}, {hi:g}]"
                reward = min(max(reward, lo), hi)
            if error is not None:
                self._record(ex, error, reward)
            out.append(Scored(reward, error, parts or none))
        return out

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def workdir(self) -> str | None:
        """The worker's private working directory (removed with the worker); None inline."""
        return self._workdir

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + 1.0
        while not self._exited() and time.monotonic() < deadline:
            time.sleep(0.005)
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
        sweep_orphans()
        self._workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR}{os.getpid()}-")
        # a fresh pipe per worker: a killed worker may have left a half-written message in the old one
        method = self._start_method or default_start_method()
        if (
            method == "spawn"
            and self._start_method is None
            and not ray_session_up()
            and not _pickles(self.task)
        ):
            method = "fork"  # a task spawn cannot carry (defined where it cannot be imported by name)
        ctx = mp.get_context(method)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_worker_main,
            name=f"reward-{self.task.name}",
            daemon=True,
            args=(
                self.task,
                self.sandbox,
                self._workdir,
                child,
                self._progress,
                os.getpid(),
                self.timeout_s / 10,
            ),
        )
        self._proc.start()
        child.close()
        # wait for the worker to be up, so a slow start (spawn imports) never counts as a hang; its
        # first message comes before it runs any reward code, so it may be believed
        try:
            if self._conn.poll(_START_TIMEOUT_S):
                mechanisms, notes, abi = json.loads(self._conn.recv_bytes(1 << 16))
                self._note_sandbox(Held(tuple(mechanisms), notes, abi))
                return
        except (EOFError, OSError, ValueError):
            pass
        self._stop()
        raise RuntimeError(
            f"reward worker for {self.task.name} failed to start within "
            f"{_START_TIMEOUT_S}s (exit code {self._proc_exitcode}); under "
            f"start_method='spawn' the task must be picklable and importable"
        )

    def _note_sandbox(self, held: Held) -> None:
        """Log what the sandbox holds, and what it lacks and why, once per guard."""
        if self.held is None:
            abi = f" (Landlock ABI {held.landlock_abi})" if held.landlock_abi else ""
            log.info(
                "reward sandbox for %s: %s%s",
                self.task.name,
                ", ".join(held.mechanisms) or "limits only",
                abi,
            )
            for name, why in held.notes.items():
                log.warning("reward sandbox for %s: %s: %s", self.task.name, name, why)
        self.held = held

    def _stop(self) -> None:
        """Kill the worker's process group (the worker and every process it left), then reap it. The
        worker is not reaped before the kill, so its pid (the group's id) cannot have been reused."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # died before it made its group
            self._proc.kill()
        self._proc.join()
        self._proc_exitcode = self._proc.exitcode
        self._conn.close()
        self._proc = self._conn = None
        shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None

    def _replace(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def _run(self, pairs: list, pending: list[int], raw: list) -> list[int]:
        """Send `pending` (indices into pairs) as one batch and fill `raw` until it is done or its
        worker fails; then fail the current item, replace the worker and return the indices still
        unscored (those after it, and any finished but not yet flushed before it)."""
        self._t_sent = time.monotonic()
        self._progress[_T0], self._progress[_IDX] = self._t_sent, _WAITING
        self._batch_deadline = self._t_sent + self.timeout_s * len(pending)
        self._conn.send([pairs[i] for i in pending])
        left = set(range(len(pending)))
        while left:
            failed = None
            try:
                if self._conn.poll(self._wait_s()):
                    data = self._conn.recv_bytes(self._row_bytes * len(pending))
                    rows = _decode(data, len(pending), self._parts)
                    for i, reward, error, parts in rows:
                        raw[pending[i]] = (reward, error, parts)
                        left.discard(i)
                    if any(error == _LEAKED for _, _, error, _ in rows):
                        self._replace()
                        return [pending[j] for j in sorted(left)]
                    continue
                failed = self._timeout()
            except (EOFError, OSError):
                failed = "worker died"  # its end of the pipe closed
            except (ValueError, TypeError, ArithmeticError, RecursionError):
                failed = "worker died (sent a malformed message)"
            if failed is None:
                continue
            i = self._current()
            if i not in left:  # not started yet (or died just after an item): blame the next one
                i = min(left)
            self._stop()
            if failed == "worker died":
                failed = f"worker died ({_exit_text(self._proc_exitcode)})"
            raw[pending[i]] = (0.0, failed, ())
            left.discard(i)
            self.restarts += 1
            self._start()
            return [pending[j] for j in sorted(left)]
        return []

    def _t0(self) -> float:
        """The current item's start as the worker reports it, kept within what can be true."""
        t0 = self._progress[_T0]
        return t0 if self._t_sent <= t0 <= time.monotonic() else self._t_sent

    def _current(self) -> int:
        i = self._progress[_IDX]
        return int(i) if math.isfinite(i) else -1

    def _deadline(self) -> float:
        return min(self._t0() + self.timeout_s, self._batch_deadline)

    def _wait_s(self) -> float:
        return max(0.0, self._deadline() - time.monotonic()) + 1e-3

    def _timeout(self) -> str | None:
        """Why the current item failed, or None if it is still within its time."""
        if self._exited():
            return "worker died"
        if time.monotonic() >= self._deadline():
            return f"timeout after {self.timeout_s}s"
        return None

    def _exited(self) -> bool:
        """Whether the worker has exited, without reaping it (so its pid, the id of the group that
        `_stop` kills, cannot be reused meanwhile). Not through multiprocessing's sentinel: the
        sandbox points the worker's copy of it at /dev/null with every other inherited descriptor."""
        try:
            return os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped elsewhere (multiprocessing reaps finished children)
            return True

    def _record(self, example: Example, error: str, reward: float) -> None:
        self.errors[error_kind(error)] += 1
        log.warning("reward of %s example %s forced to %g: %s", self.task.name, example.id, reward, error)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
