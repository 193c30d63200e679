"""The driver's tool pool: calls run off the caller's thread, their answers come back as events that
wake a wait, and a call that raises is an answer (`Failed`), never an exception in the driver."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import wait

from tailrace.runtime.tools import Failed, ToolPool


def test_answers_wake_the_wait_and_a_raising_call_is_an_answer():
    pool = ToolPool(2)
    main = threading.get_ident()
    try:
        assert wait([pool.waitable], 0.01) == []  # nothing yet
        pool.submit("a", lambda: threading.get_ident() != main)
        pool.submit("b", lambda: 1 / 0)
        got = {}
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            if wait([pool.waitable], 1.0):
                got.update({d.key: d for d in pool.take()})
        assert got["a"].value is True  # it ran on a pool thread
        assert isinstance(got["b"].value, Failed) and got["b"].value.error.startswith("ZeroDivisionError")
        assert got["a"].t0 <= got["a"].t1 and pool.in_flight == 0
    finally:
        pool.close()


def test_a_slow_call_does_not_hold_the_others():
    pool = ToolPool(2)
    try:
        pool.submit("slow", lambda: time.sleep(0.5) or "slow")
        pool.submit("fast", lambda: "fast")
        wait([pool.waitable], 2.0)
        first = [d.key for d in pool.take()]
        assert first == ["fast"]
    finally:
        pool.close()
