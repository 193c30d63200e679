"""The sandbox of reward and code-execution processes (DESIGN.md §4, invariant 9). Linux only.

`enter(cfg, workdir)` turns a fresh child into a sandbox for good; RewardGuard's worker enters one
before it runs any reward, and `isolated.run_isolated` runs one function per fresh child (a code
task's completion). What holds, by mechanism:

Everywhere (any Linux, any user)
- its own session and process group, killed as a whole (SIGKILL) on timeout, on close and when a
  reward leaks processes; it is a subreaper, so a reward that returns while a descendant lives is
  caught (`leaked_children`) even if the descendant's parent has exited;
- limits (limits.py): address space (+`memory_mb`), file size, process count, CPU (per reward call),
  no core files;
- a private working directory (mode 0700, also HOME and TMPDIR), removed with the process;
- every descriptor inherited from the trainer (sockets, log files, GPU devices) points at /dev/null;
  standard output and error too when they are regular files;
- no_new_privs: setuid programs gain nothing.
Optional mechanisms (`SandboxConfig.mechanisms`), each used where the OS allows it:
- "netns": an empty network namespace: no network at all, the machine's own loopback and abstract
  unix sockets included. Root makes one directly; another user through a user namespace, which some
  kernels and container runtimes refuse (Ubuntu's AppArmor default, Docker's seccomp profile).
- "uid" (root only): a throwaway uid; the process limit then counts the sandbox alone, and signals,
  ptrace and file permissions treat it as a stranger. When Python lives where only root can read
  (pyenv under /root) it keeps CAP_DAC_READ_SEARCH, and file reads are left to Landlock.
- "landlock" (Linux >= 5.13, unprivileged): reads only beneath the system's programs and
  libraries, Python and the packages imported so far (plus `read_paths`); writes only beneath its
  directory; no TCP bind or connect (ABI >= 4); no signals to, or abstract sockets of, processes
  outside it (ABI >= 6). So no other run's files, checkpoints, /tmp, /home or /proc.
- "seccomp" (x86_64, aarch64): socket() (any family; socketpair stays), io_uring, setsid, setpgid,
  ptrace, process_vm_* and kill(-1) refused: no network even without a namespace, no unix-socket
  service of the machine (docker, dbus), and no descendant leaves the process group the guard kills.
`Held` says which took effect and why any did not; the guard logs it once per task.

Without namespaces (a CI VM, a container) but with Landlock and seccomp, sockets are still refused
by seccomp, files confined by Landlock and descendants kept in the group, but the process limit
counts every process of the user (it is set above those already running: a loose bound). Without
Landlock (Linux < 5.13) files are contained only by the uid: as the caller's own uid, not at all;
without seccomp, a descendant can setsid out of the group and survive the kill, and a unix socket
the uid may connect to by path (docker.sock for the docker group) is reachable: neither the
namespace nor Landlock (up to ABI 7) covers those. Never contained: the
trainer's memory image, which a forked worker shares (environment variables included) — readable
by reward code, but with no network and no writable path outside its directory it can only leave
through the reward value; and disk use beyond `file_mb` per file inside the private directory.
"""

from tailrace.tasks.sandbox.config import MECHANISMS, SandboxConfig
from tailrace.tasks.sandbox.jail import Held, active, enter, leaked_children

__all__ = ["MECHANISMS", "Held", "SandboxConfig", "active", "enter", "leaked_children"]
