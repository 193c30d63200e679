"""A seccomp-bpf filter that refuses the system calls a sandboxed process could escape with.

Refused, with an errno (Python raises OSError; the process goes on):
- socket(), of any family (EACCES): no network, whatever the namespaces, and none of the machine's
  unix-socket services either (docker, dbus: a connect by path that only file permissions guard).
  socketpair() stays: asyncio and multiprocessing pipes use it, and it reaches nothing outside;
- io_uring_setup (EPERM): io_uring opens and connects sockets without calling socket();
- setsid and setpgid (EPERM): every descendant stays in the process group the guard kills;
- ptrace, process_vm_readv/writev (EPERM): no reading or writing another process's memory;
- kill(-1, ...) (EPERM): no signalling every process of the uid at once.
A call from another ABI (32-bit or x32 on x86_64) kills the process: the filter checks numbers of
the native ABI only. The filter is inherited by children and cannot be removed.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0: its low 32 bits, little-endian)
_X32_BIT = 0x40000000

# AUDIT_ARCH and syscall numbers per machine
_ABIS = {
    "x86_64": (
        0xC000003E,
        dict(
            socket=41,
            kill=62,
            ptrace=101,
            setpgid=109,
            setsid=112,
            process_vm_readv=310,
            process_vm_writev=311,
            io_uring_setup=425,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            socket=198,
            kill=129,
            ptrace=117,
            setpgid=154,
            setsid=157,
            process_vm_readv=270,
            process_vm_writev=271,
            io_uring_setup=425,
        ),
    ),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def program(machine: str) -> bytes:
    """The filter for `machine` (platform.machine()), as the kernel's array of sock_filter."""
    arch, nr = _ABIS[machine]
    p = [_insn(_LD_W_ABS, _ARCH), _insn(_JEQ_K, arch, 1, 0), _insn(_RET_K, _KILL_PROCESS)]
    p.append(_insn(_LD_W_ABS, _NR))
    if machine == "x86_64":
        p += [_insn(_JGE_K, _X32_BIT, 0, 1), _insn(_RET_K, _KILL_PROCESS)]
    p += [_insn(_JEQ_K, nr["socket"], 0, 1), _insn(_RET_K, _ERRNO | errno.EACCES)]
    for name in ("setsid", "setpgid", "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup"):
        p += [_insn(_JEQ_K, nr[name], 0, 1), _insn(_RET_K, _ERRNO | errno.EPERM)]
    # kill(-1, sig) -> EPERM; anything else passes
    p += [
        _insn(_JEQ_K, nr["kill"], 0, 3),
        _insn(_LD_W_ABS, _ARG0),
        _insn(_JEQ_K, 0xFFFFFFFF, 0, 1),
        _insn(_RET_K, _ERRNO | errno.EPERM),
        _insn(_RET_K, _ALLOW),
    ]
    return b"".join(p)


class _Prog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def install() -> str | None:
    """Install the filter on this process (no_new_privs must be set); None, or why not."""
    machine = platform.machine()
    if machine not in _ABIS:
        return f"no syscall table for {machine}"
    code = program(machine)
    prog = _Prog(len(code) // 8, code)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(ctypes.get_errno(), '?')}"
    return None
