"""LocalHosts starts each worker from the fork server (procs.context): the worker takes the driver's
environment and output as they are when it starts, not as they were when the fork server started."""

import os

from tailrace.runtime.hosts import LocalHosts


def _say(conn, counter, key: str) -> None:
    print(f"{key}={os.environ.get(key)}", flush=True)


def test_a_worker_takes_the_drivers_environment_and_output_as_it_starts(capfd, monkeypatch):
    hosts = LocalHosts()
    first = hosts.start("w-first", _say, ("TAILRACE_TEST_HOSTS",))  # the fork server is up by now
    first.proc.join(30)
    monkeypatch.setenv("TAILRACE_TEST_HOSTS", "set-after-the-fork-server")
    second = hosts.start("w-second", _say, ("TAILRACE_TEST_HOSTS",))
    second.proc.join(30)
    assert (first.proc.exitcode, second.proc.exitcode) == (0, 0)
    out = capfd.readouterr().out  # the test's capture of fd 1: the workers wrote to it
    assert "TAILRACE_TEST_HOSTS=None" in out
    assert "TAILRACE_TEST_HOSTS=set-after-the-fork-server" in out
