"""RewardGuard against hostile reward code: each attack is contained, scores 0 with a counted
reason, and the guard goes on scoring. Every attack scores 1 where it does harm, so each test fails
when the protection it checks is removed (test_sandbox.py shows each mechanism alone). A test that
needs a mechanism this machine lacks skips; the first test fails if one the machine has is missing."""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from tailrace.tasks.guard import RewardGuard, Scored
from tailrace.tasks.sandbox import MECHANISMS, SandboxConfig, landlock
from tailrace.tasks.sandbox.namespaces import others_can_read
from tests.tasks.hostile import EX, Hostile, attack, marked

TIMEOUT = 1.0
CFG = SandboxConfig(procs=16, memory_mb=256, file_mb=1, cpu_s=1)


@pytest.fixture(scope="module")
def guard():
    with RewardGuard(Hostile(), timeout_s=TIMEOUT, sandbox=CFG) as g:
        yield g


@pytest.fixture(autouse=True)
def carries_on(guard):
    """Before and after every test: the guard scores an honest response."""
    guard.errors.clear()
    assert guard.score(EX, "ok") == Scored(1.0)
    yield
    assert guard.score(EX, "ok") == Scored(1.0)


def name() -> str:
    return "tr-" + uuid.uuid4().hex[:10]


def wait_gone(comm: str, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while marked(comm) and time.monotonic() < deadline:
        time.sleep(0.02)
    return marked(comm)


def needs(guard, mechanism: str) -> None:
    if mechanism not in guard.held.mechanisms:
        pytest.skip(f"no {mechanism} here: {guard.held.notes.get(mechanism)}")


def test_the_sandbox_holds_every_mechanism_this_machine_allows(guard):
    held = set(guard.held.mechanisms)
    assert set(MECHANISMS) <= held | set(guard.held.notes), guard.held  # every absence explained
    assert ("landlock" in held) == (landlock.abi() > 0), guard.held
    assert "seccomp" in held or platform.machine() not in ("x86_64", "aarch64"), guard.held
    if os.geteuid() == 0:
        assert {"netns", "uid"} <= held, guard.held


def test_reading_another_runs_files_is_refused(guard, tmp_path):
    needs(guard, "landlock")
    run = tmp_path / "runs" / "other"
    run.mkdir(parents=True)
    (run / "secret.txt").write_text("api-key")  # world-readable, as a run directory usually is
    assert guard.score(EX, attack("read", str(run / "secret.txt"))) == Scored(
        0.0, f"raised PermissionError: [Errno 13] Permission denied: '{run / 'secret.txt'}'"
    )
    assert guard.errors == {"raised PermissionError": 1}


def test_one_sandbox_cannot_read_anothers_directory(guard):
    needs(guard, "landlock")
    with RewardGuard(Hostile(), timeout_s=TIMEOUT, sandbox=CFG) as other:
        assert other.score(EX, attack("write", "secret.txt")) == Scored(1.0)  # its own directory: fine
        secret = os.path.join(other.workdir, "secret.txt")
        assert os.path.exists(secret)
        got = guard.score(EX, attack("read", secret))
    assert got.reward == 0.0 and got.error.startswith("raised PermissionError")


def test_writing_outside_its_directory_is_refused(guard, tmp_path):
    needs(guard, "landlock")
    for target in (tmp_path / "escape.txt", "/tmp/tailrace-escape.txt", "/dev/shm/tailrace-escape.txt"):
        got = guard.score(EX, attack("write", str(target)))
        assert got.reward == 0.0 and got.error.startswith("raised PermissionError"), got
        assert not os.path.exists(target)


def test_files_past_the_size_limit_fail(guard):
    got = guard.score(EX, attack("big_file", 2))
    assert got == Scored(0.0, "raised OSError: [Errno 27] File too large")


@pytest.fixture
def server():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    yield srv
    srv.close()


def test_opening_a_socket_is_refused(guard, server):
    needs(guard, "seccomp")
    got = guard.score(EX, attack("connect", server.getsockname()[1]))
    assert got == Scored(0.0, "raised PermissionError: [Errno 13] Permission denied")
    with pytest.raises(TimeoutError):
        server.accept()


def test_sockets_the_trainer_had_open_are_not_inherited(server):
    """A socket open in the trainer when the worker forks reaches nothing from inside. (Forked as a
    run's first worker is; one spawned beside other threads inherits no descriptor at all.)"""
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    with RewardGuard(Hostile(), timeout_s=TIMEOUT, sandbox=CFG, start_method="fork") as g:
        got = g.score(EX, attack("use_fd", client.fileno()))
    assert got.reward == 0.0 and got.error.startswith(
        "raised OSError: [Errno 88] Socket operation on non-socket"
    )
    conn.settimeout(0.2)
    with pytest.raises(TimeoutError):
        conn.recv(16)
    client.close(), conn.close()


def test_a_memory_hog_fails_to_allocate(guard):
    assert guard.score(EX, attack("hog", 1024)) == Scored(0.0, "raised MemoryError")


def test_sleeping_forever_times_out_and_the_worker_is_replaced(guard):
    pid, restarts = guard.worker_pid, guard.restarts
    assert guard.score(EX, attack("sleep")) == Scored(0.0, f"timeout after {TIMEOUT}s")
    assert guard.worker_pid != pid and guard.restarts == restarts + 1


def test_cpu_past_the_limit_kills_the_worker(guard):
    """cpu_s=1: SIGXCPU once the item has used one to two CPU seconds, before its wall timeout."""
    with RewardGuard(Hostile(), timeout_s=10.0, sandbox=CFG) as g:
        assert g.score(EX, attack("spin")) == Scored(0.0, "worker died (killed by SIGXCPU)")
        assert g.score(EX, "ok") == Scored(1.0)


def test_a_fork_bomb_is_held_to_the_process_limit_and_killed_whole(guard):
    comm, seen = name(), []
    scorer = threading.Thread(target=lambda: seen.append(guard.score(EX, attack("fork_bomb", comm))))
    scorer.start()
    peak = 0
    while scorer.is_alive():
        peak = max(peak, len(marked(comm)))
        time.sleep(0.05)
    scorer.join()
    assert seen == [Scored(0.0, f"timeout after {TIMEOUT}s")]
    assert 1 < peak <= CFG.procs + 1  # the worker and its procs children, not 2**8
    assert wait_gone(comm) == []


def test_a_grandchild_left_running_is_killed_and_the_reward_void(guard):
    needs(guard, "seccomp")  # without it the grandchild's setsid takes it out of the group
    comm, restarts = name(), guard.restarts
    got = guard.score(EX, attack("leave_grandchild", comm))
    assert got.reward == 0.0 and got.error.startswith("leaked processes")
    assert guard.errors == {"leaked processes": 1} and guard.restarts == restarts + 1
    assert wait_gone(comm) == []  # it ignored SIGTERM and tried setsid; the group kill is SIGKILL


def test_a_hang_with_a_stubborn_grandchild_leaves_no_process(guard):
    needs(guard, "seccomp")
    comm = name()
    assert guard.score(EX, attack("grandchild_and_hang", comm)) == Scored(0.0, f"timeout after {TIMEOUT}s")
    assert wait_gone(comm) == []


def test_a_forged_start_time_does_not_stop_the_timeout(guard):
    t0 = time.monotonic()
    assert guard.score(EX, attack("forge_progress")) == Scored(0.0, f"timeout after {TIMEOUT}s")
    assert time.monotonic() - t0 < TIMEOUT + 2.0


def test_the_workers_messages_are_data_not_pickles(guard, tmp_path):
    target = tmp_path / "unpickled"
    got = guard.score(EX, attack("send_pickle", str(target)))
    assert got == Scored(0.0, "worker died (sent a malformed message)")
    assert not target.exists()
    assert guard.score(EX, attack("send_nested", 1200)) == Scored(
        0.0, "worker died (sent a malformed message)"
    )


def test_long_non_ascii_reasons_come_back_whole(guard):
    got = guard.score(EX, attack("raise_long", "错误"))
    assert got == Scored(0.0, "raised ValueError: " + "错误" * 100)


STRANGER = 54321  # an unprivileged uid with no processes and no files


def _stranger_python() -> str | None:
    """A Python interpreter that another uid can run with this tree on its path: this one, unless it
    lives where only root can read (pyenv under /root), else the system's."""
    repo = str(Path(__file__).parents[2])
    for exe in (sys.executable, "/usr/bin/python3"):
        probe = "import os, sys; print(sys.prefix, os.path.dirname(os.__file__), sys.version_info >= (3, 10))"
        try:
            out = subprocess.run(
                [exe, "-c", probe], capture_output=True, text=True, timeout=30
            ).stdout.split()
        except OSError:
            continue
        if out[2:] == ["True"] and all(others_can_read(p) for p in (exe, out[0], out[1], repo)):
            return exe
    return None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="run as root to test the unprivileged path too (CI runs it directly)"
)
def test_an_unprivileged_user_gets_the_same_containment(server):
    """Without root: no throwaway uid; a user namespace for the network where the OS allows one,
    the process limit counted in it (or above the user's own processes), Landlock and seccomp."""
    python = _stranger_python()
    if python is None:
        pytest.skip("no Python here that an unprivileged uid can run")
    secret_dir = tempfile.mkdtemp()
    try:
        os.chmod(secret_dir, 0o755)  # readable by everyone: only the sandbox may stop the read
        secret = os.path.join(secret_dir, "secret.txt")
        Path(secret).write_text("api-key")
        os.chmod(secret, 0o644)
        script = textwrap.dedent(f"""
            import json, os
            from tailrace.tasks.guard import RewardGuard
            from tailrace.tasks.sandbox import MECHANISMS, SandboxConfig, landlock
            from tests.tasks.hostile import EX, Hostile, attack
            with RewardGuard(Hostile(), timeout_s=5.0, sandbox=SandboxConfig(procs=8)) as g:
                scored = [g.score(EX, attack(*a)) for a in (
                    ("read", {secret!r}), ("write", {secret_dir + "/dropped"!r}),
                    ("connect", {server.getsockname()[1]}), ("fork_count", 50), ("value", 0.5))]
                print(json.dumps([os.getuid(), g.held.mechanisms, [[s.reward, s.error] for s in scored]]))
        """)
        env = {"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin:/bin", "HOME": secret_dir}
        out = subprocess.run(
            [python, "-c", script], capture_output=True, text=True, timeout=120, env=env,
            user=STRANGER, group=STRANGER, extra_groups=[], cwd="/",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        uid, held, scored = json.loads(out.stdout)
        assert uid == STRANGER and "uid" not in held and "seccomp" in held
        assert ("landlock" in held) == (landlock.abi() > 0)
        read, write, connect, forks, honest = scored
        assert read == [0.0, f"raised PermissionError: [Errno 13] Permission denied: '{secret}'"]
        assert write[0] == 0.0 and write[1].startswith("raised PermissionError")
        assert connect == [0.0, "raised PermissionError: [Errno 13] Permission denied"]
        assert 0 < forks[0] * 100 <= 8 and forks[1] is None
        assert honest == [0.5, None]
        assert not os.path.exists(os.path.join(secret_dir, "dropped"))
    finally:
        shutil.rmtree(secret_dir)
