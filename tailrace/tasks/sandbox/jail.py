"""enter(): make this process a sandbox; leaked_children(): what a finished piece of work left behind.

`enter` runs in a fresh, single-threaded child (the reward worker, or one code run) before any
untrusted code, in an order where each step still has what it needs: its own session (so the
guard's kill of the group reaches every descendant) and the subreaper bit (so orphaned grandchildren
stay its children), inherited descriptors pointed at /dev/null, the network namespace, the private
working directory (handed to the throwaway uid), the uid, the limits, then Landlock and seccomp, which
both need no_new_privs and forbid what came before.
"""

from __future__ import annotations

import ctypes
import os
import site
import stat
import sys
import tempfile
from dataclasses import dataclass, field

from tailrace.tasks.sandbox import landlock, limits, namespaces, seccomp
from tailrace.tasks.sandbox.config import MECHANISMS, SandboxConfig

_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38

# Readable inside: the system's programs and libraries, a few files of /etc that libc reads, the
# harmless devices, and the CPU topology that os.cpu_count() reads. Not /proc, not /tmp, not /home.
_SYSTEM_PATHS = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin",
    "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
    "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/sys/devices/system/cpu",
)  # fmt: skip

_held: Held | None = None  # this process's sandbox; None outside one


@dataclass(frozen=True)
class Held:
    mechanisms: tuple[str, ...]  # optional mechanisms in force, in MECHANISMS order
    notes: dict[str, str] = field(default_factory=dict)  # mechanism -> why it is absent or weakened
    landlock_abi: int = 0  # which Landlock guarantees hold (see landlock.py); 0 without


def active() -> Held | None:
    """The sandbox this process is in (entered here or inherited through fork); None outside one."""
    return _held


def python_paths() -> list[str]:
    """The interpreter, its site-packages and the top-level package (or file) of every module
    imported so far: what Python code needs to read to go on importing."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if "." not in name and file:
            paths.add(os.path.dirname(file) if os.path.basename(file) == "__init__.py" else file)
    return sorted(paths)


def enter(cfg: SandboxConfig, workdir: str, keep_fds: tuple[int, ...] = ()) -> Held:
    """Sandbox this process for good, with `workdir` (created by the caller) as its private working
    directory; descriptors 0-2 and `keep_fds` stay usable, every other inherited one is /dev/null."""
    global _held
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # seccomp, Landlock and unshare bind the calling thread only
        raise RuntimeError(
            f"a sandbox must be entered by a single-threaded process, this one has {threads} threads; "
            f"enter it in a freshly forked child, before anything starts a thread"
        )
    want, notes, absent = set(cfg.mechanisms), {}, set(MECHANISMS) - set(cfg.mechanisms)

    def failed(name: str, why: str | None) -> bool:
        if why is not None:
            notes[name] = why
            absent.add(name)
        return why is not None

    libc = ctypes.CDLL(None, use_errno=True)
    os.setsid()
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _neuter_fds(keep_fds)
    root = os.geteuid() == 0
    if "netns" in want:
        failed("netns", namespaces.unshare_net())
    if "uid" in want and not failed("uid", None if root else "not root: runs as the caller's uid"):
        uid = namespaces.sandbox_uid()
        os.chown(workdir, uid, uid)
        private = [p for p in python_paths() if not namespaces.others_can_read(p)]
        if private:
            notes["uid"] = f"keeps CAP_DAC_READ_SEARCH: {private[0]} is readable by root only"
        namespaces.drop_to(uid, keep_reads=bool(private))
    # the process count starts at this process for a throwaway uid, and in a user namespace of our
    # own on kernels that count per namespace (Linux >= 5.14)
    own_userns = not root and "netns" not in absent
    fresh_uid = "uid" not in absent or (own_userns and _kernel() >= (5, 14))

    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    tempfile.tempdir = workdir
    limits.apply(cfg, fresh_uid)

    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # also: setuid programs run without their privileges
    abi = 0
    if "landlock" in want:
        abi, why = landlock.restrict(
            [*_SYSTEM_PATHS, *python_paths(), *cfg.read_paths], [workdir, "/dev/null"]
        )
        failed("landlock", why)
    if "seccomp" in want:
        failed("seccomp", seccomp.install())
    _held = Held(tuple(m for m in MECHANISMS if m not in absent), notes, abi)
    return _held


def leaked_children() -> bool:
    """Whether this process still has a live child once the exited ones are reaped. As a subreaper
    it inherits orphaned grandchildren, so this finds every process a finished piece of work left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _neuter_fds(keep: tuple[int, ...]) -> None:
    """Point every inherited descriptor but 0-2 and `keep` at /dev/null (a fork inherits the trainer's
    sockets and log files). The numbers stay taken: copied objects that own them may close them later.
    Standard output and error that are regular files go too: the file-size limit would fail writes."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        regular_stdio = fd in (1, 2) and stat.S_ISREG(_mode(fd))
        if fd != devnull and (fd > 2 and fd not in keep or regular_stdio):
            os.dup2(devnull, fd, inheritable=fd <= 2)
    os.close(devnull)


def _mode(fd: int) -> int:
    try:
        return os.fstat(fd).st_mode
    except OSError:
        return 0


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
