"""Worker processes, both ends: how the driver starts, hears, checks, stops and replaces them
(`Workers`), and how a worker runs its loop (`serving`).

A worker starts with Ctrl-C ignored (the driver handles it and shuts the workers down) and a `Pulse`
beating. Every exception it raises goes to the driver as a `Failed` message (type, message, and
whether it is bad input) before it exits with code 1, silently; a worker whose driver is gone (its
pipe closed) just exits. On the driver's side a worker that raised becomes one exception with one
line: `InputError` for bad input, `Fault` for the rest. A worker lost otherwise — a closed pipe, a dead
process, a stopped heartbeat — is killed (SIGKILL ends a stopped process too) and, when the driver
recovers workers, comes back once as a `Lost` message (what it had sent but not yet been read is
dropped: the driver redoes that work); else it raises `Fault` too. Messages to a worker go out through
its own sender thread, in order: a stopped worker whose pipe is full blocks that thread, never the
driver, which finds the worker stuck by its heartbeat.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import current_process
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tailrace.common import Fault, InputError, one_line
from tailrace.runtime.health import Health, Lost, Pulse, exit_reason
from tailrace.runtime.hosts import Hosts, LocalHosts, Started
from tailrace.runtime.messages import Failed, Ready, Shutdown
from tailrace.runtime.procs import name_process

# -- the worker's side ---------------------------------------------------------------------------


@contextmanager
def serving(conn: Connection, counter: Any) -> Iterator[None]:
    """Around a worker's whole body: beat, and report any exception to the driver before exiting. The
    process takes its worker's name (`tr-engine0`, `tr-trainer`: runtime/procs.py) once it has beaten:
    a worker stopped as soon as it shows (a chaos test's SIGSTOP) is found stuck after the usual
    timeout, not after the first beat's start-up allowance (health.STARTUP_S)."""
    counter.value += 1
    Pulse(counter).start()
    name_process(f"tr-{current_process().name}")
    try:
        yield
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the driver is gone: there is no one to tell
    except SystemExit:  # told to end (Ray turns SIGTERM into this): the driver finds a death, not a fault
        raise
    except BaseException as e:  # noqa: BLE001 — whatever it is, the driver hears it, in one line
        try:
            conn.send(
                Failed(type(e).__name__, one_line(e), isinstance(e, InputError), traceback.format_exc())
            )
        except OSError:
            pass
        sys.exit(1)


# -- the driver's side ---------------------------------------------------------------------------


class Sender(threading.Thread):
    """Sends one worker's messages in order until it gets None or the pipe breaks (the worker died)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(name="sender", daemon=True)
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while (msg := self.inbox.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError:  # the worker is gone: its health check says how
                return

    def stop(self) -> None:
        """After the worker exited or was killed (so a send blocked on a full pipe fails)."""
        self.inbox.put(None)
        self.join(timeout=5)


@dataclass(eq=False)
class Worker:
    name: str
    proc: Any  # a multiprocessing Process
    conn: Connection
    health: Health
    sender: Sender
    lost: bool = False  # killed and no longer heard: the driver replaces it or stops
    elastic: bool = False  # joined the run (runtime/join.py): its loss always comes back as `Lost`


class Workers:
    """The driver's worker processes. `errors_log` receives the traceback of a worker's fault.
    `recover`: a lost worker comes back from `receive` as a `Lost` message instead of raising.
    `hosts`: where the processes run (runtime/hosts.py; default: this machine). `explain`: what the
    run adds to the line of a fault it stops on (e.g. the memory it holds, after a SIGKILL)."""

    def __init__(
        self,
        timeout_s: float,
        errors_log: Path | None = None,
        recover: bool = False,
        hosts: Hosts | None = None,
        explain: Callable[[Lost], str] = lambda lost: "",
    ) -> None:
        self.hosts, self.explain = hosts or LocalHosts(), explain
        self.timeout_s, self.errors_log, self.recover = timeout_s, errors_log, recover
        self.all: list[Worker] = []
        self.retired: list[Worker] = []  # workers that left the run, shut down at `close`

    def start(self, name: str, target: Callable[..., None], *args: Any) -> Worker:
        """Start `target(conn, counter, *args)` in a new process on this machine or the cluster."""
        return self.adopt(name, self.hosts.start(name, target, args))

    def adopt(self, name: str, s: Started, elastic: bool = False) -> Worker:
        """A worker started elsewhere (`elastic`: an engine that joined the run, runtime/join.py, whose
        loss never stops the run), heard and checked from now on like the driver's own."""
        health = Health(name, s.proc, s.counter, self.timeout_s)
        w = Worker(name, s.proc, s.conn, health, Sender(s.conn), elastic=elastic)
        w.sender.start()
        self.all.append(w)
        return w

    def retire(self, w: Worker) -> None:
        """`w` leaves the run (an engine told to leave, or a joined one lost): it is told to shut down
        if it still can be, no longer heard or checked, and waited for at `close`."""
        if w in self.all:
            self.all.remove(w)
        self.send(w, Shutdown())
        w.lost = True  # nothing more is read from it
        self.retired.append(w)

    def replace(self, old: Worker, target: Callable[..., None], *args: Any) -> Worker:
        """A fresh process under `old`'s name (`old` is lost: already killed); it says `Ready` when up."""
        self.all.remove(old)
        return self.start(old.name, target, *args)

    def ready(self, among: Sequence[Worker]) -> None:
        """Wait for the `Ready` of each of `among` (as long as each is alive and beating): a worker
        lost while starting is a `Fault`, whatever `recover` says."""
        waiting = set(among)
        while waiting:
            for w, msg in self.receive(list(waiting), timeout=1.0):
                if isinstance(msg, Lost):
                    raise Fault(msg.line + self.explain(msg))
                if isinstance(msg, Ready):
                    waiting.discard(w)

    def receive(
        self, among: Sequence[Worker] | None = None, timeout: float = 1.0, wake: Sequence[Any] = ()
    ) -> list[tuple[Worker, Any]]:
        """The messages `among` (default: all) sent within `timeout`; then every worker is checked,
        and each one lost since comes once as `(worker, Lost)` (or raises `Fault`: see `recover`).
        `wake`: other waitables (a tool pool's socket) that end the wait when readable.
        Raises `InputError` or `Fault` for a worker that failed."""
        by_conn = {w.conn: w for w in (self.all if among is None else among) if not w.lost}
        got = []
        for conn in wait(list(by_conn) + list(wake), timeout):
            if conn not in by_conn:
                continue
            w = by_conn[conn]
            if not w.lost:
                got.append((w, self._recv(w)))
        now = time.monotonic()
        for w in self.all:
            verdict = None if w.lost else w.health.verdict(now)
            if verdict is not None:
                got.append((w, self._lose(w, verdict)))
        if not self.recover:
            for w, msg in got:
                if isinstance(msg, Lost) and not w.elastic:
                    raise Fault(msg.line + self.explain(msg))
        return got

    def send(self, w: Worker, msg: Any) -> None:
        """Queue `msg` for `w`'s sender (never blocks); a lost worker's messages are dropped."""
        if not w.lost:
            w.sender.inbox.put(msg)

    def close(self) -> None:
        live = [w for w in self.all if not w.lost]  # a lost one is already killed and closed
        for w in self.retired:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()
            w.sender.stop()
            w.conn.close()
        self.retired = []
        for w in live:
            self.send(w, Shutdown())
        for w in live:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()  # stopped or stuck: SIGKILL ends a stopped process too
                w.proc.join(timeout=5)
            w.sender.stop()
            w.conn.close()
        self.all = []

    def _recv(self, w: Worker) -> Any:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(timeout=5)
            return self._lose(w, _died(w))
        if isinstance(msg, Failed):
            return self._lose(w, self._failure(w, msg))
        return msg

    def _lose(self, w: Worker, lost: Lost) -> Lost:
        """Kill `w` for good (a stuck one may only be stopped) and stop hearing it. A dead worker's
        last words say more than its exit code: a `Failed` still in its pipe raises."""
        while not w.proc.is_alive() and w.conn.poll():
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Failed):
                lost = self._failure(w, msg)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5)
        w.lost = True
        w.sender.stop()
        w.conn.close()
        return lost

    def _failure(self, w: Worker, f: Failed) -> Lost:
        """A worker's error: raised, a fault of the run, from one of the run's own workers; the loss of
        an engine that joined the run (it ends that engine alone: it leaves)."""
        err = self._failed(w, f)
        if not w.elastic:
            raise err
        return Lost(w.name, "failed", one_line(err))

    def _failed(self, w: Worker, f: Failed) -> Exception:
        if f.input:
            return InputError(f"{w.name}: {f.message}")
        where = ""
        if self.errors_log is not None:
            with open(self.errors_log, "a") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {w.name}\n{f.details}\n")
            where = f" (traceback in {self.errors_log})"
        return Fault(f"{w.name} failed: {f.kind}: {f.message}{where}")


def _died(w: Worker) -> Lost:
    return Lost(w.name, "died", f"{w.name} process died ({exit_reason(w.proc.exitcode)})")
