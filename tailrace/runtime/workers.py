"""Worker processes, both ends: how the driver starts, hears, checks and stops them (`Workers`), and
how a worker runs its loop (`serving`).

A worker starts with Ctrl-C ignored (the driver handles it and shuts the workers down) and a `Pulse`
beating. Every exception it raises goes to the driver as a `Failed` message (type, message, and
whether it is bad input) before it exits with code 1, silently; a worker whose driver is gone (its
pipe closed) just exits. The driver's side turns each way a worker can be lost — `Failed`, a closed
pipe, a dead process, a stopped heartbeat — into one exception with one line: `InputError` for a
worker's bad-input error, `Fault` for the rest.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tailrace.common import Fault, InputError, one_line
from tailrace.runtime.health import Health, Pulse, exit_reason
from tailrace.runtime.messages import Failed, Ready, Shutdown
from tailrace.runtime.procs import context

# -- the worker's side ---------------------------------------------------------------------------


@contextmanager
def serving(conn: Connection, counter: Any) -> Iterator[None]:
    """Around a worker's whole body: beat, and report any exception to the driver before exiting."""
    Pulse(counter).start()
    try:
        yield
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the driver is gone: there is no one to tell
    except BaseException as e:  # noqa: BLE001 — whatever it is, the driver hears it, in one line
        try:
            conn.send(
                Failed(type(e).__name__, one_line(e), isinstance(e, InputError), traceback.format_exc())
            )
        except OSError:
            pass
        sys.exit(1)


# -- the driver's side ---------------------------------------------------------------------------


@dataclass(eq=False)
class Worker:
    name: str
    proc: Any  # a multiprocessing Process
    conn: Connection
    health: Health


class Workers:
    """The driver's worker processes. `errors_log` receives the traceback of a worker's fault."""

    def __init__(self, timeout_s: float, errors_log: Path | None = None) -> None:
        self.ctx = context()
        self.timeout_s, self.errors_log = timeout_s, errors_log
        self.all: list[Worker] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> Worker:
        """Start `target(conn, counter, *args)` in a new process."""
        conn, child = self.ctx.Pipe()
        counter = self.ctx.Value("Q", 0, lock=False)
        proc = self.ctx.Process(target=target, args=(child, counter, *args), name=name, daemon=True)
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is the driver's
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, sigint)
        child.close()  # only the worker holds its end now: when it dies, ours reads end-of-file
        w = Worker(name, proc, conn, Health(name, proc, counter, self.timeout_s))
        self.all.append(w)
        return w

    def ready(self, among: Sequence[Worker]) -> None:
        """Wait for the `Ready` of each of `among` (as long as each is alive and beating)."""
        waiting = set(among)
        while waiting:
            for w, msg in self.receive(list(waiting), timeout=1.0):
                if isinstance(msg, Ready):
                    waiting.discard(w)

    def receive(
        self, among: Sequence[Worker] | None = None, timeout: float = 1.0
    ) -> list[tuple[Worker, Any]]:
        """The messages `among` (default: all) sent within `timeout`; then every worker is checked.
        Raises `InputError` or `Fault` for a lost worker."""
        by_conn = {w.conn: w for w in (self.all if among is None else among)}
        got = []
        for conn in wait(list(by_conn), timeout):
            w = by_conn[conn]
            got.append((w, self._recv(w)))
        self.check()
        return got

    def send(self, w: Worker, msg: Any) -> None:
        try:
            w.conn.send(msg)
        except OSError:  # its end is closed: it died; say how
            while w.conn.poll():
                self._recv(w)
            w.proc.join(timeout=5)
            raise Fault(f"{w.name} process died ({exit_reason(w.proc.exitcode)})") from None

    def check(self) -> None:
        now = time.monotonic()
        for w in self.all:
            verdict = w.health.check(now)
            if verdict is not None:
                while w.conn.poll():  # a dead worker's last words say more than its exit code
                    self._recv(w)
                raise Fault(verdict)

    def close(self) -> None:
        for w in self.all:
            try:
                w.conn.send(Shutdown())
            except OSError:
                pass
        for w in self.all:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()  # stopped or stuck: SIGKILL ends a stopped process too
                w.proc.join(timeout=5)
            w.conn.close()
        self.all = []

    def _recv(self, w: Worker) -> Any:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(timeout=5)
            raise Fault(f"{w.name} process died ({exit_reason(w.proc.exitcode)})") from None
        if isinstance(msg, Failed):
            raise self._failed(w, msg)
        return msg

    def _failed(self, w: Worker, f: Failed) -> Exception:
        if f.input:
            return InputError(f"{w.name}: {f.message}")
        where = ""
        if self.errors_log is not None:
            with open(self.errors_log, "a") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {w.name}\n{f.details}\n")
            where = f" (traceback in {self.errors_log})"
        return Fault(f"{w.name} failed: {f.kind}: {f.message}{where}")
