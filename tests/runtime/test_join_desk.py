"""The driver's join desk ends with the run: no thread left blocked in its listener's accept."""

import threading
import time

from tailrace.runtime.join import Desk


def desk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "join-desk"]


def test_a_closed_desk_leaves_no_thread_and_no_files(tmp_path):
    """Closing the listener alone left its thread blocked on the still-bound socket: a thread and a port
    for every run that ended in a process that lives on (a notebook, the tests)."""
    before = desk_threads()
    desk = Desk(tmp_path)
    assert len(desk_threads()) == len(before) + 1 and (tmp_path / "join.json").exists()
    desk.close()
    deadline = time.monotonic() + 5
    while len(desk_threads()) > len(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert desk_threads() == before
    assert not (tmp_path / "join.json").exists() and not (tmp_path / "join.key").exists()
