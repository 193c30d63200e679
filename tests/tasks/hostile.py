"""Hostile reward code for the sandbox tests: each attack returns 1.0 when it did harm, so a test
that expects 0 fails as soon as the protection against it is gone."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import signal
import socket
import time
from pathlib import Path

from tailrace.tasks.base import Example, Task


def set_comm(name: str) -> None:
    """Name this process (/proc/PID/comm) so a test can find it from outside."""
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def marked(name: str) -> list[int]:
    """Live processes named `name` (zombies awaiting a reaper do not count)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm == name[:15] and state not in ("Z", "X"):
            pids.append(int(pid))
    return pids


def read(path: str) -> float:
    return float(bool(Path(path).read_text()))


def write(path: str) -> float:
    Path(path).write_text("escaped")
    return 1.0


def connect(port: int) -> float:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return 1.0


def use_fd(fd: int) -> float:
    """Send on a descriptor the worker inherited from its parent."""
    socket.socket(fileno=fd).sendall(b"stolen")
    return 1.0


def hog(mb: int) -> float:
    return float(len(bytearray(mb << 20)) > 0)


def big_file(mb: int) -> float:
    Path("big").write_bytes(b"x" * (mb << 20))
    return 1.0


def spin(_) -> float:
    while True:
        pass


def sleep(_) -> float:
    time.sleep(3600)
    return 1.0


def fork_bomb(name: str) -> float:
    """2**8 processes if nothing stops it (a bound, so a broken sandbox fails the test and not the
    machine); every one sleeps, and the reward never returns."""
    set_comm(name)
    for _ in range(8):
        try:
            os.fork()
        except OSError:
            pass
    time.sleep(3600)
    return 1.0


def fork_count(n: int) -> float:
    """Fork up to n (<= 100) sleeping children, then kill them; the share of n that it got."""
    kids = []
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(3600)
        kids.append(pid)
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return len(kids) / 100


def _stubborn_grandchild(name: str) -> None:
    """Fork a child that forks a grandchild and exits: the grandchild ignores SIGTERM, tries to
    leave the process group, and sleeps."""
    if os.fork() == 0:
        if os.fork() == 0:
            set_comm(name)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                os.setsid()
            except OSError:
                pass
            time.sleep(3600)
        os._exit(0)
    os.wait()


def leave_grandchild(name: str) -> float:
    _stubborn_grandchild(name)
    time.sleep(0.2)  # the grandchild is named (and has tried setsid) before the reward returns
    return 1.0


def grandchild_and_hang(name: str) -> float:
    _stubborn_grandchild(name)
    time.sleep(3600)
    return 1.0


def value(v: float) -> float:
    return v


def forge_progress(_) -> float:
    """Claim the current item started far in the future, then hang: a guard that believed the
    worker's clock would wait forever (here: 10 s, then score 1)."""
    for obj in gc.get_objects():
        if type(obj).__name__ == "c_double_Array_2":
            obj[1] = 1e18
    time.sleep(10)
    return 1.0


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def send_pickle(path: str) -> float:
    """Send the guard a pickle that creates `path` when loaded (it must be read as data)."""
    return _send(pickle.dumps(_CreatesFile(path)))


def send_nested(depth: int) -> float:
    """Send the guard JSON nested deeper than Python's recursion limit."""
    return _send(b"[" * depth)


def raise_long(text: str) -> float:
    raise ValueError(text * 1000)


def _send(payload: bytes) -> float:
    from multiprocessing.connection import Connection

    for obj in gc.get_objects():
        if isinstance(obj, Connection) and not obj.closed and obj.writable:
            try:
                obj.send_bytes(payload)
            except OSError:
                pass
    return 1.0


ATTACKS = {
    f.__name__: f
    for f in (read, write, connect, use_fd, hog, big_file, spin, sleep, fork_bomb, fork_count, leave_grandchild,
              grandchild_and_hang, value, forge_progress, send_pickle, send_nested, raise_long)
}  # fmt: skip


def attack(name: str, arg: object = None) -> str:
    """The response that makes Hostile's reward run attack `name` with `arg`."""
    return json.dumps([name, arg])


class Hostile(Task):
    name = "hostile"

    def examples(self, split, n, seed=0):
        return [Example(i, f"q{i}", "ok") for i in range(n)]

    def reward(self, example, response):
        if response == "ok":
            return 1.0
        name, arg = json.loads(response)
        return ATTACKS[name](arg)


EX = Example(0, "q0", "ok")
