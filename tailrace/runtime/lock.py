"""An exclusive lock on a run directory, held for the life of the process that runs it.

`flock` on RUN_DIR/run.lock: the kernel releases it when the process ends, however it ends (kill -9
included), so a stale lock cannot exist. The holder writes its pid and command line into the file;
a second process that wants the directory is refused with them, in one line.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
from pathlib import Path

from tailrace.common import ConfigError

NAME = "run.lock"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        path = run_dir / NAME
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise ConfigError(
                f"cannot lock {run_dir} ({e.strerror}); a run directory must be writable: copy it to a "
                "writable place (cp -r) and use the copy"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise ConfigError(
                f"{run_dir} is in use by {holder}; wait for it to end (or stop it), then continue with "
                f"tailrace train --resume {run_dir}"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} ({_command()})\n".encode())

    def release(self) -> None:
        os.close(self._fd)  # closing the only descriptor releases the lock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _command() -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("__main__.py", "tailrace"):
        argv[0] = "tailrace"
    return shlex.join(argv)[:300]
