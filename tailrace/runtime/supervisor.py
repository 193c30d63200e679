"""Supervised training (`tailrace train --supervise`): the driver runs as a child process, and a driver
that dies of a fault is resumed from its run directory with `--resume`, as a person would.

A fault is a death by a signal the driver does not handle (SIGKILL, SIGSEGV, ...) or the fault exit
code 3 (a worker lost past its restarts, non-finite training, a full disk). Bad input (exit 2), a
finished run (0) and an interrupted one (130, 143) end the supervisor with the child's code; so does
anything after the supervisor itself got Ctrl-C or SIGTERM (it passes either on to the driver, which
runs in a session and process group of its own: the group is killed after the driver ends, so no worker of a dead
driver outlives it). Restarts are bounded as a worker's are (runtime/recovery.py: `max_restarts`
within any hour); past that the supervisor stops with exit code 3 and one line.

The resumed driver writes the restart's `recovery` event itself, once its workers are up, so the
downtime runs from the death to a working driver (a driver that dies before it is up extends the
outage, as a worker's replacement does): the supervisor hands it the loss in the
environment (`LOST_ENV`, read once by the CLI), not as a flag a person would type.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from tailrace.records import EvalRecord, Mark, read_metrics
from tailrace.runtime.health import Lost, exit_reason
from tailrace.runtime.recovery import Recovery
from tailrace.runtime.rundir import extended, policy_dirs

LOST_ENV = "TAILRACE_DRIVER_LOST"
FAULT = 3  # the CLI's exit code for a fault (tailrace/cli/__init__.py)


@dataclass(frozen=True)
class DriverLost:
    """How the previous driver ended, for the `recovery` event its successor writes."""

    cause: str  # died (a signal) or fault (exit code 3)
    detail: str  # the supervisor's line
    t_lost: float  # wall clock (time.time) at the death
    steps_recorded: int  # step records it had written: those past the checkpoint are redone
    restarts: int  # the driver's restarts within the hour, this one included

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> DriverLost | None:
        raw = os.environ.get(LOST_ENV)
        return cls(**json.loads(raw)) if raw else None

    def mark(self, t: float, steps_done: int) -> Mark:
        """The `recovery` mark at run time `t`, the resumed driver being up with `steps_done` steps."""
        data = {
            "worker": "driver", "cause": self.cause, "detail": self.detail,
            "downtime_s": round(time.time() - self.t_lost, 3), "requeued": 0,
            "replayed": max(0, self.steps_recorded - steps_done), "restarts": self.restarts,
        }  # fmt: skip
        return Mark(t, "recovery", data)


def lost_driver(rc: int) -> Lost | None:
    """The loss an exit status means, or None for an ending that a restart must not undo."""
    if rc < 0:
        return Lost("driver", "died", f"the driver process died ({exit_reason(rc)})")
    if rc == FAULT:
        return Lost("driver", "fault", "the driver stopped on a fault (exit code 3, its line above)")
    return None


def supervise(argv: list[str], run_dir: Path, max_restarts: int, say: Callable[[str], None]) -> int:
    """Run `tailrace train ARGV` (which must write to `run_dir`) until it ends other than by a fault,
    resuming it after each fault while `max_restarts` allows. Returns the exit code to end with."""
    recovery = Recovery(max_restarts)
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def on_signal(signum, frame) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)  # the driver shuts its workers down and says how to go on

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    env = dict(os.environ)
    env.pop(LOST_ENV, None)
    prev, seen = None, 0  # the last restart's loss, and the driver recoveries recorded before it
    try:
        while True:
            # its own session and process group: what a dead driver leaves behind (workers that have
            # not noticed yet, one stopped) is killed with it before its successor starts. (setsid is
            # done in C: a preexec_fn after torch's threads started can deadlock the fork.)
            child = subprocess.Popen(
                [sys.executable, "-m", "tailrace.cli", "train", *argv], env=env, start_new_session=True
            )
            rc = child.wait()
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # nothing left
            lost = None if stopping else lost_driver(rc)
            if lost is None:
                return rc if rc >= 0 else 128 - rc
            if finished(run_dir):  # it died after writing the final evaluation: nothing to resume
                say(f"supervisor: {lost.line} after the run finished; nothing to resume")
                return 0
            now = time.monotonic()
            if not recovery.allows(lost, now):
                say(f"supervisor: {recovery.refusal(lost)}; continue with tailrace train --resume {run_dir}")
                return FAULT
            recovery.begin(lost, now)
            n = recovery.restarts(lost.worker, now)
            say(
                f"supervisor: {lost.line}; resuming it from {run_dir} (restart {n} of at most "
                f"{max_restarts} within the hour)"
            )
            gone = DriverLost(lost.cause, lost.line, time.time(), _steps_recorded(run_dir), n)
            if prev is not None and _driver_recoveries(run_dir) == seen:
                # the last resumed driver died before it was up: one outage, from the first loss
                steps = max(prev.steps_recorded, gone.steps_recorded)
                gone = replace(gone, t_lost=prev.t_lost, steps_recorded=steps)
            prev, seen = gone, _driver_recoveries(run_dir)
            argv = ["--resume", str(run_dir)]
            env = {**env, LOST_ENV: gone.to_env()}
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def finished(run_dir: Path) -> bool:
    """The run wrote its final evaluation, every policy of several its own (what `--resume` refuses as
    finished: runtime/resume.py, cli/commands.py)."""
    policies = policy_dirs(run_dir)
    if policies:
        return all(finished(p) for p in policies)
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged line: the resume says so
        records = read_metrics(run_dir / "metrics.jsonl")
        final = any(isinstance(r, EvalRecord) and r.tag == "final" for r in records)
    return final and not extended(run_dir)


def _driver_recoveries(run_dir: Path) -> int:
    """The driver's `recovery` events so far (a resumed driver writes one once its workers are up)."""
    try:
        with open(run_dir / "events.jsonl", errors="replace") as f:
            return sum('"kind":"recovery"' in line and '"worker":"driver"' in line for line in f)
    except OSError:
        return 0


def _steps_recorded(run_dir: Path) -> int:
    """Step records written so far, every policy's."""
    policies = policy_dirs(run_dir)
    if policies:
        return sum(_steps_recorded(p) for p in policies)
    try:
        return (run_dir / "metrics.jsonl").read_text(errors="replace").count('"kind":"step"')
    except OSError:
        return 0
