"""Hostile code for the sandbox tests, and a way to find the processes it leaves."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path


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
