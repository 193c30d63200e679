"""run_isolated: one function call in a fresh, sandboxed child process, under a wall-clock limit.

For work that must start clean every time (a model's completion run against its tests, a multi-turn
run's Python tool): the child is forked from the caller, or, where forking the caller is unsafe (other
threads run in it, or Ray's), by multiprocessing's fork server. Inside a sandboxed reward worker it
inherits that sandbox; anywhere else (inline scoring, the driver's tool threads) it enters one of its
own. It gets `cpu_s` CPU seconds of its own, an empty working directory, the memory and file-size limits
of `cfg` (or the worker's, where lower), no descriptor but its result pipe, /dev/null for its input and
output, and `timeout_s` of wall time; then it is killed, with its process group when it made one
(outside a worker). Inside a worker, processes it started are found and killed by the worker's leak
check. Its result comes back as one line of JSON, read as data: the caller checks what it means.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from tailrace.tasks.sandbox.config import SandboxConfig
from tailrace.tasks.sandbox.jail import active, enter
from tailrace.tasks.sandbox.limits import limit_run

_MAX_RESULT = 1 << 16  # bytes of result read back; a pipe holds this much without blocking its writer


class Contained(Exception):
    """The run did not finish by itself: it timed out, was killed by a limit, or exited without a result."""


def run_isolated(fn: Callable[..., Any], args: tuple, cfg: SandboxConfig, timeout_s: float) -> Any:
    """`fn(*args)`'s JSON value, computed in a sandboxed child; Contained(why) when there is none.

    Inside a worker the child is forked (it must inherit the worker's sandbox). Elsewhere it is forked
    only while forking is safe (`may_fork`); otherwise the fork server forks it, and `fn` and `args`
    must pickle (a module-level function)."""
    inside = active() is not None
    workdir = _scratch() if inside else tempfile.mkdtemp(prefix="tailrace-run-")
    r, w = os.pipe()
    try:
        if inside or may_fork():
            pid = os.fork()
            if pid == 0:  # the child: never returns
                os.close(r)
                _child(fn, args, cfg, workdir, w)
            done, reap = os.pidfd_open(pid), lambda: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        else:
            result = Connection(os.dup(w), readable=False)  # pickles as the descriptor, passed on
            try:
                proc = mp.get_context("forkserver").Process(
                    target=_child, args=(fn, args, cfg, workdir, result)
                )
                proc.start()
            finally:
                result.close()
            pid, done = proc.pid, os.dup(proc.sentinel)
            reap = lambda: proc.join() or proc.exitcode  # noqa: E731
    finally:
        os.close(w)
    try:
        finished = bool(select.select([done], [], [], timeout_s)[0])
        data = _read_available(r)
    finally:
        os.close(r)
        _kill(pid)
        os.close(done)
        code = reap()
        if inside:
            _empty(workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if not finished:
        raise Contained(f"timeout after {timeout_s}s")
    if code < 0:
        sig = signal.Signals(-code).name
        raise Contained(f"killed by {sig}" + (" (CPU limit)" if sig == "SIGXCPU" else ""))
    line = data.split(b"\n", 1)[0]
    if code != 0 or not line:
        raise Contained(f"exited with code {code} without a result")
    try:
        return json.loads(line)
    except ValueError:
        raise Contained(f"sent a malformed result {line[:60]!r}") from None


def may_fork() -> bool:
    """Whether a child forked from this process starts clean: no other Python thread runs here (one
    may hold a lock at the fork, the import lock or a logger's, that the child then waits on until
    its timeout) and no Ray session is up (gRPC's threads, which Python does not list; CI saw a child
    forked then die with SIGSEGV). Asked at each run: threads and sessions come and go."""
    return threading.active_count() == 1 and not ray_session_up()


def ray_session_up() -> bool:
    ray = sys.modules.get("ray")  # looked up, not imported: a process that never used Ray does not load it
    return ray is not None and ray.is_initialized()


def _child(
    fn: Callable[..., Any], args: tuple, cfg: SandboxConfig, workdir: str, w: int | Connection
) -> None:
    """The child's whole life: never returns. `w`: the result pipe's descriptor (a Connection when
    the fork server started it: the descriptor it got may have another number)."""
    code = 1
    try:
        w = w if isinstance(w, int) else w.fileno()
        _prepare(cfg, workdir, w)
        os.write(w, json.dumps(fn(*args)).encode() + b"\n")
        code = 0
    finally:
        os._exit(code)


def _scratch() -> str:
    """Inside a worker, the runs' directory beneath its private one: runs there come one after
    another, and each finds it empty (made once: removing a directory can take milliseconds)."""
    path = os.path.join(tempfile.gettempdir(), "run")
    os.makedirs(path, exist_ok=True)
    return path


def _empty(path: str) -> None:
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


def _prepare(cfg: SandboxConfig, workdir: str, result_fd: int) -> None:
    kept = sorted({result_fd, *limit_run(cfg)})
    # no descriptor but those: not the worker's channel to the guard, nor anything else it holds
    # (this process runs no code of the worker's, so closing cannot pull one from under it)
    for low, high in zip([2, *kept], [*kept, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]):
        os.closerange(low + 1, high)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # what the run prints is noise in the trainer's log
        os.dup2(devnull, fd)
    os.close(devnull)
    if active() is None:
        enter(cfg, workdir, keep_fds=(result_fd,))
    else:
        os.chdir(workdir)


def _read_available(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < _MAX_RESULT:
        try:
            chunk = os.read(fd, _MAX_RESULT - size)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _kill(pid: int) -> None:
    """Kill the (unreaped) child and, when it made one, its process group."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
