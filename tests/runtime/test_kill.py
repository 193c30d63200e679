"""Killing a worker the driver did not start (a Ray actor's process, a joined engine): by pid, a moment
after the decision, so the pid is checked against the process's start time first (procs.started_at);
a pid reused meanwhile is another process, left alone."""

import signal
import subprocess

import pytest

from tailrace.runtime.join import JoinedProcess
from tailrace.runtime.procs import kill_process, started_at


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_the_kill_leaves_a_process_that_reuses_the_pid_alone(sleeper):
    start = started_at(sleeper.pid)
    kill_process(sleeper.pid, start + 1)
    assert sleeper.poll() is None
    kill_process(sleeper.pid, start)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    kill_process(sleeper.pid, start)  # gone (reaped): nothing to do


def test_a_joined_process_is_the_one_that_joined_not_whoever_has_its_pid(sleeper):
    start = started_at(sleeper.pid)
    other = JoinedProcess(sleeper.pid, start + 1)  # the joiner that had this pid before
    assert not other.is_alive()
    other.kill()
    assert sleeper.poll() is None
    joined = JoinedProcess(sleeper.pid, start)
    assert joined.is_alive() and JoinedProcess(sleeper.pid).is_alive()
    joined.kill()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not joined.is_alive()
