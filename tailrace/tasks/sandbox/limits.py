"""Resource limits (setrlimit): the part of the sandbox every POSIX system has.

- RLIMIT_AS: the address space may grow by `memory_mb` from its size at `apply` (a forked worker
  starts as large as the trainer that forked it); past it allocations fail (MemoryError).
- RLIMIT_FSIZE: no file grows past `file_mb` (the write fails with EFBIG; Python ignores SIGXFSZ).
- RLIMIT_NPROC: at most `procs` processes beyond those the uid already runs. The kernel counts every
  process of the real uid (per user namespace since Linux 5.14) and never limits root: it holds for a
  throwaway uid or a fresh user namespace, and only loosely for a uid shared with other work.
- RLIMIT_CPU: `CpuBudget.arm` gives the next piece of work `cpu_s` CPU seconds (soft limit: SIGXCPU,
  which kills the process; the hard limit stays open so it can be re-armed for the next piece).
- RLIMIT_CORE: 0, no core files from killed processes.
"""

from __future__ import annotations

import math
import os
import resource
import time

from tailrace.tasks.sandbox.config import SandboxConfig

_MB = 1 << 20


_statm: int | None = None  # the sandbox's /proc/self/statm, opened by `apply` before Landlock hides /proc


def vm_bytes() -> int:
    """This process's address-space size now. Inside a sandbox, through the descriptor `apply` kept:
    in a child forked since, that is the parent's size, which was the child's at the fork."""
    if _statm is None:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    return int(os.pread(_statm, 64, 0).split()[0]) * os.sysconf("SC_PAGE_SIZE")


def uid_processes(uid: int) -> int:
    """Processes whose /proc entry belongs to `uid` (its effective uid; the same here)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except FileNotFoundError:
                pass
    return n


def _set(limit: int, value: int) -> None:
    """Soft and hard `limit` to `value`, or to the hard limit already in force when that is lower."""
    hard = resource.getrlimit(limit)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))


def apply(cfg: SandboxConfig, fresh_uid: bool) -> None:
    """Set the limits of this process (inherited by its children). `fresh_uid`: no other process
    of this uid runs outside the sandbox, so the process count starts at this one."""
    global _statm
    _statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    running = 1 if fresh_uid else uid_processes(os.getuid())
    _set(resource.RLIMIT_NPROC, running + cfg.procs)
    _set(resource.RLIMIT_CORE, 0)
    limit_run(cfg, cpu=False)


def limit_run(cfg: SandboxConfig, cpu: bool = True) -> list[int]:
    """Memory and file size from `cfg`, and with `cpu` all of `cfg.cpu_s` for this (new) process;
    limits only go down, so a run inside a worker keeps the tighter of the two. Returns the
    descriptors the limits keep using."""
    _set(resource.RLIMIT_AS, vm_bytes() + cfg.memory_mb * _MB)
    _set(resource.RLIMIT_FSIZE, cfg.file_mb * _MB)
    if cpu:
        _set(resource.RLIMIT_CPU, cfg.cpu_s)  # a new process: its count starts at 0
    return [] if _statm is None else [_statm]


class CpuBudget:
    """Gives each piece of work `cpu_s` CPU seconds, give or take one: re-arming takes two system
    calls, so it happens only once the process has used a second since the last arming."""

    def __init__(self, cpu_s: int) -> None:
        self.cpu_s, self._armed_at = cpu_s, -math.inf
        self._hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def arm(self) -> None:
        used = time.process_time()  # CPU time of the whole process, what RLIMIT_CPU counts
        if used - self._armed_at < 1.0:
            return
        soft = int(used) + self.cpu_s + 1  # +1: the kernel counts whole seconds
        if self._hard != resource.RLIM_INFINITY:
            soft = min(soft, self._hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, self._hard))
        self._armed_at = used
