"""RewardGuard: failures of user reward code become reward 0 with a reason; the run goes on."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tailrace.tasks.base import Example, Task
from tailrace.tasks.guard import RewardGuard, Scored, default_start_method

TIMEOUT = 0.5


class Scripted(Task):
    """The response says what the reward does: a number is compared to the answer."""

    name = "scripted"

    def examples(self, split, n, seed=0):
        return [Example(i, f"q{i}", str(i)) for i in range(n)]

    def reward(self, example, response):
        if response == "raise":
            raise ValueError("boom\nsecond line")
        if response == "hang":
            time.sleep(60)
        if response == "exit":
            os._exit(3)
        if response in ("nan", "inf"):
            return float(response)
        if response == "str":
            return "1.0"
        if response == "bool":
            return True
        if response.startswith("value "):
            return float(response.split()[1])
        return 1.0 if response == example.answer else 0.0


EX = Scripted().examples("train", 256)


@pytest.fixture
def guard():
    with RewardGuard(Scripted(), timeout_s=TIMEOUT) as g:
        yield g


def test_correct_and_wrong_answers_pass_through(guard):
    assert guard.score(EX[3], "3") == Scored(1.0, None)
    assert guard.score(EX[3], "4") == Scored(0.0, None)
    assert not guard.errors


def test_raising_reward_is_zero_with_reason_counted_and_logged(guard, caplog):
    with caplog.at_level(logging.WARNING, logger="tailrace.tasks"):
        got = guard.score(EX[1], "raise")
    assert got == Scored(0.0, "raised ValueError: boom second line")
    assert guard.errors == {"raised ValueError": 1}
    assert "example 1 forced to 0: raised ValueError" in caplog.text
    assert guard.score(EX[2], "2").reward == 1.0  # the same worker carries on
    assert guard.restarts == 0


@pytest.mark.parametrize(
    "response, reason",
    [
        ("nan", "bad value: nan"),
        ("inf", "bad value: inf"),
        ("str", "bad value: returned str '1.0', expected float"),
        ("bool", "bad value: returned bool 'True', expected float"),
    ],
)
def test_non_finite_or_non_float_is_zero(guard, response, reason):
    assert guard.score(EX[0], response) == Scored(0.0, reason)
    assert guard.errors == {"bad value": 1}


def test_hang_times_out_and_the_worker_is_replaced(guard):
    pid = guard.worker_pid
    t0 = time.monotonic()
    assert guard.score(EX[0], "hang") == Scored(0.0, f"timeout after {TIMEOUT}s")
    assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + 2.0
    assert guard.errors == {"timeout": 1} and guard.restarts == 1
    assert guard.worker_pid != pid and not _alive(pid)
    assert guard.score(EX[5], "5") == Scored(1.0, None)


def test_batch_with_hang_crash_and_raise_still_scores_the_rest(guard):
    responses = ["0", "raise", "hang", "3", "exit", "5", "6"] + [str(i) for i in range(7, 100)]
    got = guard.score_many(list(zip(EX, responses)))
    assert [s.reward for s in got] == [1, 0, 0, 1, 0] + [1] * 95
    assert got[1].error.startswith("raised ValueError")
    assert got[2].error == f"timeout after {TIMEOUT}s"
    assert got[4].error == "worker died (exit code 3)"
    assert guard.errors == {"raised ValueError": 1, "timeout": 1, "worker died": 1}
    assert guard.restarts == 2


def test_rewards_outside_the_declared_range_are_clamped_and_counted(guard):
    got = guard.score_many([(EX[0], "value 1.7"), (EX[0], "value -0.5"), (EX[0], "value 0.5")])
    assert got == [
        Scored(1.0, "clamped: returned 1.7, outside the task's range [0, 1]"),
        Scored(0.0, "clamped: returned -0.5, outside the task's range [0, 1]"),
        Scored(0.5),
    ]
    assert guard.errors == {"clamped": 2}


def test_a_declared_range_is_honoured():
    class Signed(Scripted):
        reward_range = (-1.0, 1.0)

    g = RewardGuard(Signed(), inline=True)
    assert g.score(EX[0], "value -0.5") == Scored(-0.5)
    assert g.score(EX[0], "value -2") == Scored(
        -1.0, "clamped: returned -2, outside the task's range [-1, 1]"
    )
    with pytest.raises(ValueError, match=r"reward_range \(1.0, 0.0\) must be \(low, high\) with low < high"):
        RewardGuard(type("Backwards", (Scripted,), {"reward_range": (1.0, 0.0)})(), inline=True)


def test_inline_mode_catches_exceptions_without_a_worker():
    g = RewardGuard(Scripted(), inline=True)
    assert g.worker_pid is None
    got = g.score_many([(EX[0], "0"), (EX[1], "raise"), (EX[2], "nan")])
    assert got == [
        Scored(1.0),
        Scored(0.0, "raised ValueError: boom second line"),
        Scored(0.0, "bad value: nan"),
    ]
    assert g.errors == {"raised ValueError": 1, "bad value": 1}


def test_spawn_worker_gets_the_task_once_and_times_out_too():
    with RewardGuard(Scripted(), timeout_s=TIMEOUT, start_method="spawn") as g:
        got = g.score_many([(EX[0], "0"), (EX[1], "hang"), (EX[2], "2")])
        assert got == [Scored(1.0), Scored(0.0, f"timeout after {TIMEOUT}s"), Scored(1.0)]


def test_a_worker_is_spawned_not_forked_while_a_ray_session_is_up(monkeypatch):
    """gRPC's threads in a Ray driver make a forked child crash at random (CI: exit code -11)."""

    class FakeRay:
        up = False

        def is_initialized(self):
            return self.up

    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # as in a driver with no other thread
    assert default_start_method() == "fork"
    ray.up = True
    assert default_start_method() == "spawn"


@pytest.fixture
def another_thread():
    """A second Python thread running in this process, as a run's join desk or tool threads do."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()


def test_a_worker_is_spawned_while_another_thread_runs_and_scores_and_is_replaced(another_thread):
    """A lock the other thread held at a fork would stay held in the child: spawn instead (fork + exec
    at once), the task pickled."""
    assert default_start_method() == "spawn"
    with RewardGuard(Scripted(), timeout_s=TIMEOUT) as g:
        assert g._proc._start_method == "spawn"
        got = g.score_many([(EX[0], "0"), (EX[1], "hang"), (EX[2], "2")])
        assert got == [Scored(1.0), Scored(0.0, f"timeout after {TIMEOUT}s"), Scored(1.0)]
        assert g.restarts == 1 and g._proc._start_method == "spawn"


def test_a_task_that_does_not_pickle_is_still_forked_beside_another_thread(another_thread):
    task = Scripted()
    task.unpicklable = threading.Lock()  # a task spawn cannot carry
    with RewardGuard(task, timeout_s=TIMEOUT) as g:
        assert g._proc._start_method == "fork"
        assert g.score_many([(EX[3], "3"), (EX[4], "raise")])[0] == Scored(1.0)


def test_close_and_context_manager_end_the_worker():
    with RewardGuard(Scripted()) as g:
        pid = g.worker_pid
        assert _alive(pid)
    assert g.worker_pid is None
    time.sleep(0.05)
    assert not _alive(pid)


class _Counted:
    """A pipe end that counts the messages through it."""

    def __init__(self, conn):
        self.conn, self.sent, self.received = conn, 0, 0

    def send(self, obj):
        self.sent += 1
        return self.conn.send(obj)

    def recv_bytes(self, *args):
        self.received += 1
        return self.conn.recv_bytes(*args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_batch_is_one_message_each_way():
    """128 cheap items are one round trip, not 128: the worker flushes early only once a batch has run
    timeout_s / 10 (6 s here), so the count does not depend on how busy the machine is. (Its time per item
    is bench/guard.py's to measure, not a unit test's.)"""
    with RewardGuard(Scripted(), timeout_s=60.0) as g:
        pairs = [(ex, ex.answer) for ex in EX[:128]]
        g.score_many(pairs)  # the worker is up
        g._conn = counted = _Counted(g._conn)
        for _ in range(3):
            assert all(s.reward == 1.0 for s in g.score_many(pairs))
        assert (counted.sent, counted.received) == (3, 3)


def test_worker_dies_with_its_parent(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from tests.tasks.test_guard import Scripted
        from tailrace.tasks.guard import RewardGuard
        g = RewardGuard(Scripted())
        print(g.worker_pid, g.workdir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid, workdir = out.stdout.split()
    shutil.rmtree(workdir)  # a killed parent leaves its worker's directory behind
    deadline = time.monotonic() + 5.0
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid))


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_the_worker_directories_a_killed_process_left_are_swept(tmp_path, monkeypatch):
    """A reward worker's directory carries its guard's pid: one whose process no longer runs (a run
    killed with -9) is removed when a guard starts a worker; a live process's, and others, stay."""
    import tempfile

    from tailrace.tasks.guard import sweep_orphans

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"tailrace-reward-{dead.pid}-abc"
    (orphan / "scratch").mkdir(parents=True)
    if os.getuid() == 0:  # as the sandbox leaves it under root: owned by a throwaway uid
        os.chown(orphan, (1 << 30) + dead.pid, (1 << 30) + dead.pid)
    live = tmp_path / f"tailrace-reward-{os.getpid()}-def"
    live.mkdir()
    other = tmp_path / "tailrace-reward-notapid-x"
    other.mkdir()
    assert sweep_orphans() == 1
    assert not orphan.exists() and live.exists() and other.exists()
