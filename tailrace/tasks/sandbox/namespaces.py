"""Identity and network: a network namespace and a throwaway uid, where the OS allows them.

- `unshare_net()`: a new, empty network namespace (only a loopback that is down): no route to any
  host, the machine itself included, and none of its abstract unix sockets. Root unshares directly;
  another user needs a user namespace first (mapping its own uid and gid), which kernels or
  container runtimes may refuse.
- `drop_to(uid)` (root only): the process becomes an unprivileged uid of its own: the kernel's
  process-count limit (RLIMIT_NPROC) then counts only the sandbox, and file permissions, signals and
  ptrace treat it as a stranger to every user's files and processes. `keep_reads` keeps one
  capability, CAP_DAC_READ_SEARCH (read any file), for a Python installed where only root can read
  (pyenv under /root): then file reads are contained by Landlock alone; writes, signals and ptrace
  still by the uid. A program it executes starts without the capability.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
UID_BASE = 1 << 30  # throwaway uids: UID_BASE + pid, unique among the processes alive at one time

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> str | None:
    if _libc.unshare(flags) != 0:
        return f"unshare: {errno.errorcode.get(ctypes.get_errno(), '?')}"
    return None


def unshare_net() -> str | None:
    """Move this (single-threaded) process into a new network namespace; None, or why not."""
    if os.geteuid() == 0:
        return _unshare(_CLONE_NEWNET)
    uid, gid = os.geteuid(), os.getegid()
    why = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if why is None:
        try:  # map the same ids inside, so files keep their owners; setgroups must be denied first
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            return f"user namespace without an id map ({e.strerror})"
    return why


def sandbox_uid() -> int:
    return UID_BASE + os.getpid()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_PR_SET_KEEPCAPS, _CAPABILITY_V3, _CAP_DAC_READ_SEARCH = 8, 0x20080522, 2


def drop_to(uid: int, keep_reads: bool) -> None:
    """Become `uid` (and gid `uid`, no supplementary groups) for good; needs root."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    _libc.prctl(_PR_SET_KEEPCAPS, int(keep_reads), 0, 0, 0)
    os.setresuid(uid, uid, uid)
    if keep_reads:  # the uid change kept the permitted set and cleared the effective one
        cap = 1 << _CAP_DAC_READ_SEARCH
        data = (_CapData * 2)(_CapData(cap, cap, 0), _CapData(0, 0, 0))
        if _libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_V3, 0)), data) != 0:
            raise OSError(ctypes.get_errno(), "capset(CAP_DAC_READ_SEARCH)")
        _libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)


def others_can_read(path: str) -> bool:
    """Whether a stranger uid can reach and read `path` (every directory above it searchable)."""
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
    except OSError:
        return True  # absent: nothing to read
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    if st.st_mode & need != need:
        return False
    parent = os.path.dirname(path)
    while parent != path:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        path, parent = parent, os.path.dirname(parent)
    return True
