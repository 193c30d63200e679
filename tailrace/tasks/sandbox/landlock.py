"""Landlock (Linux >= 5.13, unprivileged): a file-system allow-list, and more on newer kernels.

After `restrict(read, write)` this process and its descendants may
- read and execute files only beneath `read` (and `write`), and create, write, rename or delete only
  beneath `write` (ABI 1; rename across directories from ABI 2, truncate from ABI 3, device ioctls
  from ABI 5) — every other path fails with EACCES, whatever the uid;
- not bind or connect TCP sockets (ABI 4);
- not signal, or connect to the abstract unix sockets of, processes outside the sandbox (ABI 6).
Files opened before the call stay usable. The restriction cannot be lifted.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Iterable

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
_NET_TCP = 0b11  # bind, connect (ABI 4)
_SCOPES = 0b11  # abstract unix sockets, signals (ABI 6)

_READ = _EXECUTE | _READ_FILE | _READ_DIR
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV  # a rule on a non-directory


class _Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock."""
    v = _libc.syscall(_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    return max(v, 0)


def _fs_rights(v: int) -> int:
    return _FS_ABI1 | (_REFER if v >= 2 else 0) | (_TRUNCATE if v >= 3 else 0) | (_IOCTL_DEV if v >= 5 else 0)


def restrict(read: Iterable[str], write: Iterable[str]) -> tuple[int, str | None]:
    """Confine this process to `read` (read, execute) and `write` (everything); paths that do not
    exist are skipped. No_new_privs must be set. (ABI used, None) or (0, why not)."""
    v = abi()
    if v < 1:
        return 0, "the kernel has no Landlock (needs Linux >= 5.13 with landlock in the LSM list)"
    handled = _fs_rights(v)
    attr = _Ruleset(handled, _NET_TCP if v >= 4 else 0, _SCOPES if v >= 6 else 0)
    size = 8 if v < 4 else 16 if v < 6 else 24  # older kernels reject fields they do not know
    fd = _libc.syscall(_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if fd < 0:
        return 0, f"landlock_create_ruleset: {errno.errorcode.get(ctypes.get_errno(), '?')}"
    try:
        for paths, rights in ((read, _READ), (write, handled)):
            for path in paths:
                _allow(fd, path, rights & handled)
        if _libc.syscall(_RESTRICT_SELF, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    except OSError as e:
        return 0, f"{e.strerror}: {errno.errorcode.get(e.errno, '?')}"
    finally:
        os.close(fd)
    return v, None


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # absent (or unreachable): nothing to allow
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        if _libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    finally:
        os.close(fd)
