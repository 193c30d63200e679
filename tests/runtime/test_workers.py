"""`Workers`: an exception in a worker of the run's own is a fault that stops the run (a bug does not go
away by restarting it), while one in an engine that joined the run (`elastic`) ends that engine alone:
it comes back as a loss, and the driver lets it leave with its samples requeued."""

import time

import pytest

from tailrace.common import Fault
from tailrace.runtime.health import Lost
from tailrace.runtime.workers import Workers, serving


def _fails(conn, counter) -> None:
    with serving(conn, counter):
        raise RuntimeError("the driver's ring no longer holds the weights of version 10")


def _received(ws: Workers, timeout_s: float = 30.0) -> list:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = ws.receive(timeout=0.2)
        if got:
            return got
    raise AssertionError("nothing came back")


def test_a_joined_engines_error_is_its_loss_and_a_run_workers_is_a_fault(tmp_path):
    log = tmp_path / "errors.log"
    ws = Workers(timeout_s=10, errors_log=log, recover=True)
    try:
        joined = ws.adopt("engine1", ws.hosts.start("engine1", _fails, ()), elastic=True)
        ((w, msg),) = _received(ws)
        assert w is joined and isinstance(msg, Lost) and msg.cause == "failed" and w.lost
        assert "engine1 failed: RuntimeError: the driver's ring no longer holds" in msg.line
        assert "Traceback" in log.read_text()  # its traceback kept, as a fault's
        ws.start("trainer", _fails)
        with pytest.raises(Fault, match="trainer failed: RuntimeError"):
            _received(ws)
    finally:
        ws.close()
