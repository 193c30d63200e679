"""One process per run directory: a second is refused in one line that names the first."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tailrace
from tailrace.common import ConfigError
from tailrace.runtime.lock import RunLock


def test_a_held_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from tailrace.runtime.lock import RunLock; "
        f"sys.argv = ['tailrace', 'train', '--run-dir=x']; RunLock(Path({str(tmp_path)!r})); "
        "print('held', flush=True); time.sleep(60)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(tailrace.__file__).parents[1]))
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as e:
            RunLock(tmp_path)
        msg = str(e.value)
        assert (
            "\n" not in msg and f"pid {holder.pid} (tailrace train --run-dir=x)" in msg and "--resume" in msg
        )
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    with RunLock(tmp_path):  # the kernel released it with the process
        pass


def test_the_lock_is_released_with_its_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(ConfigError):
            RunLock(tmp_path)
    RunLock(tmp_path).release()
