"""Is a worker process alive, dead, or stuck? Heartbeats and one check per worker.

Each worker runs a `Pulse`: a daemon thread that bumps a counter in shared memory every `BEAT_S`. The
driver holds a `Health` per worker and calls `check(now)` whenever it has waited for messages; it
answers None, or one line saying the worker died (with how) or went silent for longer than the
timeout. The beat comes from a thread, not the worker's loop, so a long trainer step, a long prefill
or a long checkpoint write never reads as stuck (torch and safetensors release the GIL while they
work); what stops the beat is a stopped process (SIGSTOP, a debugger), a frozen or starved one, or
an interpreter wedged with the GIL held. The default timeout (`worker_timeout_s`, 120 s) is
two orders above the beat, and the first beat may take `STARTUP_S` (a cold `import torch` on a
loaded machine). The driver's recovery (runtime/recovery.py) restarts a worker on the same verdicts.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailrace.runtime.messages import Beat

BEAT_S = 1.0
STARTUP_S = 300.0  # until the first beat: the worker is importing its modules


class Process(Protocol):
    exitcode: int | None

    def is_alive(self) -> bool: ...


class Pulse(threading.Thread):
    """The worker's side: `counter.value += 1` every `BEAT_S` for as long as the process runs."""

    def __init__(self, counter: Any, beat_s: float = BEAT_S) -> None:
        super().__init__(name="pulse", daemon=True)
        self.counter, self.beat_s = counter, beat_s

    def run(self) -> None:
        while True:
            self.counter.value += 1
            time.sleep(self.beat_s)


@dataclass(frozen=True)
class Lost:
    """A worker the driver no longer has: `cause` is "died", "stuck" or (an engine that joined the run)
    "failed"; `line` says how, for a person."""

    worker: str
    cause: str
    line: str


@dataclass
class Health:
    """The driver's view of one worker: its process and its pulse counter."""

    name: str
    proc: Process
    counter: Any  # a shared integer the worker's Pulse bumps
    timeout_s: float
    since: float = field(default_factory=time.monotonic)  # when the count last moved
    beats: int = 0

    def check(self, now: float) -> str | None:
        """None while the worker lives and beats; else what happened to it, in a few words."""
        lost = self.verdict(now)
        return lost.line if lost else None

    def verdict(self, now: float) -> Lost | None:
        """None while the worker lives and beats; else whether it died or is stuck, and how."""
        if not self.proc.is_alive():
            return Lost(self.name, "died", f"{self.name} process died ({exit_reason(self.proc.exitcode)})")
        beats = self.counter.value
        if beats != self.beats:
            self.beats, self.since = beats, now
            return None
        limit = self.timeout_s if beats else max(self.timeout_s, STARTUP_S)
        if now - self.since > limit:
            return Lost(
                self.name,
                "stuck",
                f"{self.name} process is stuck: no heartbeat for {now - self.since:.0f} s (stopped, "
                "frozen or starved of CPU)",
            )
        return None


def exit_reason(code: int | None) -> str:
    """`code`: the exit code, minus the signal's number when one ended it; None where the driver cannot
    see it (a Ray actor: on another host, or not its child)."""
    if code is None:
        return "exit status unseen: killed, out of memory, or its node lost"
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return f"killed by {name}" + (": out of memory?" if name == "SIGKILL" else "")


# -- a heartbeat over a connection, for a worker that shares no memory with the driver (a Ray actor,
# an engine that joined the run: runtime/ray_hosts.py, runtime/join.py)


class Beats:
    """The heartbeat counter of a worker the driver shares no memory with: each `value` its Pulse
    sets (`value += 1`) goes to the driver as a `Beat` on the beat connection."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.count = conn, 0

    @property
    def value(self) -> int:
        return self.count

    @value.setter
    def value(self, count: int) -> None:
        self.count = count
        try:
            self.conn.send(Beat(count))
        except OSError:  # the driver is gone: the worker's loop finds out and exits
            pass


class Heard(threading.Thread):
    """The driver's copy of a worker's heartbeat count (`value`, as health.Health reads a counter),
    kept by reading its beat connection until it closes."""

    def __init__(self, conn: Any) -> None:
        super().__init__(name="beats", daemon=True)
        self.conn, self.value = conn, 0
        self.start()

    def run(self) -> None:
        while True:
            try:
                self.value = self.conn.recv().count
            except (EOFError, OSError):
                return
