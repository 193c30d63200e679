"""Each sandbox mechanism alone, against the attack it exists for, next to a control run without it
(the attack then succeeds: the probe is sensitive). Runs use run_isolated outside any worker, so
each child enters a fresh sandbox with only the mechanisms named. The child is forked, or comes from
the fork server where threads of earlier tests still run here: what it runs is module-level, so
either way works."""

import ctypes
import errno
import json
import os
import platform
import socket
import threading
import time
import uuid

import pytest

from tailrace.tasks.sandbox import SandboxConfig, active, enter, isolated, landlock
from tailrace.tasks.sandbox.isolated import Contained, run_isolated
from tests.tasks.hostile import leave_grandchild, marked

ROOT = os.geteuid() == 0
LANDLOCK = landlock.abi()
SECCOMP = platform.machine() in ("x86_64", "aarch64")  # the filter's syscall tables
needs_seccomp = pytest.mark.skipif(not SECCOMP, reason=f"no seccomp filter for {platform.machine()}")


def outcome(fn, *args) -> str:
    """ "ok", "MemoryError", or the errno name of the OSError the attempt raised."""
    try:
        fn(*args)
        return "ok"
    except MemoryError:
        return "MemoryError"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))


def mechanisms_held() -> list[str]:
    return list(active().mechanisms)


def run(probe, *args, mechanisms=(), **limits):
    cfg = SandboxConfig(mechanisms=mechanisms, **limits)
    return run_isolated(outcome, (probe, *args), cfg, timeout_s=10.0)


@pytest.fixture(scope="module")
def netns():
    """Whether this machine lets the sandbox make a network namespace (root, or a user namespace)."""
    cfg = SandboxConfig(mechanisms=("netns",))
    return "netns" in run_isolated(mechanisms_held, (), cfg, timeout_s=10.0)


@pytest.fixture(scope="module")
def server():
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv.getsockname()[1]
    srv.close()


def tcp(port):
    socket.create_connection(("127.0.0.1", port), timeout=2).close()


def udp(_):
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9))


@pytest.mark.parametrize(
    "mechanisms, tcp_outcome, udp_outcome",
    [
        ((), "ok", "ok"),
        (("netns",), "ENETUNREACH", "ENETUNREACH"),  # an empty namespace: its loopback is down
        (("seccomp",), "EACCES", "EACCES"),  # socket() itself refused, every family but AF_UNIX
        (("landlock",), "EACCES", "ok"),  # ABI 4 covers TCP bind/connect only
    ],
)
def test_network_per_mechanism(server, netns, mechanisms, tcp_outcome, udp_outcome):
    if "landlock" in mechanisms and LANDLOCK < 4:
        pytest.skip(f"Landlock ABI {LANDLOCK} has no network rules")
    if "netns" in mechanisms and not netns:
        pytest.skip("this machine refuses network namespaces")
    if "seccomp" in mechanisms and not SECCOMP:
        pytest.skip(f"no seccomp filter for {platform.machine()}")
    assert run(tcp, server, mechanisms=mechanisms) == tcp_outcome
    assert run(udp, None, mechanisms=mechanisms) == udp_outcome


@pytest.fixture
def abstract_socket():
    name = f"\0tailrace-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen()
    yield name
    srv.close()


def unix_connect(name):
    socket.socket(socket.AF_UNIX).connect(name)


@pytest.mark.parametrize(
    "mechanisms, expected",
    [((), "ok"), (("netns",), "ECONNREFUSED"), (("landlock",), "EPERM")],  # landlock: ABI 6 scope
)
def test_the_machines_abstract_unix_sockets(abstract_socket, netns, mechanisms, expected):
    if "netns" in mechanisms and not netns:
        pytest.skip("this machine refuses network namespaces")
    if "landlock" in mechanisms and LANDLOCK < 6:
        pytest.skip(f"Landlock ABI {LANDLOCK} does not scope abstract unix sockets")
    assert run(unix_connect, abstract_socket, mechanisms=mechanisms) == expected


@pytest.fixture
def unix_socket(tmp_path):
    """A pathname socket anyone may connect to, as /var/run/docker.sock is for its group."""
    path = str(tmp_path / "service.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o777)
    yield path
    srv.close()


@pytest.mark.parametrize("mechanisms, expected", [((), "ok"), (("seccomp",), "EACCES")])
def test_the_machines_unix_socket_services(unix_socket, mechanisms, expected):
    if "seccomp" in mechanisms and not SECCOMP:
        pytest.skip(f"no seccomp filter for {platform.machine()}")
    assert run(unix_connect, unix_socket, mechanisms=mechanisms) == expected


def socketpair(_):
    a, b = socket.socketpair()
    a.sendall(b"x")
    assert b.recv(1) == b"x"


@needs_seccomp
def test_socketpairs_still_work_under_seccomp():
    assert run(socketpair, None, mechanisms=("seccomp",)) == "ok"


def read(path):
    open(path).read()


def write(path):
    open(path, "w").write("x")


@pytest.mark.skipif(not LANDLOCK, reason="the kernel has no Landlock")
def test_landlock_confines_reads_and_writes_to_the_allow_list(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    assert run(read, str(secret)) == "ok" and run(read, str(secret), mechanisms=("landlock",)) == "EACCES"
    assert run(write, str(tmp_path / "out")) == "ok"
    assert run(write, str(tmp_path / "out2"), mechanisms=("landlock",)) == "EACCES"
    assert run(read, os.__file__, mechanisms=("landlock",)) == "ok"  # Python's own files stay readable
    assert run(write, "inside", mechanisms=("landlock",)) == "ok"  # and its own directory writable


def signal_parent(_):
    os.kill(os.getppid(), 0)  # signal 0: the permission check alone


@pytest.mark.parametrize(
    "mechanisms, expected",
    [((), "ok"), (("uid",), "EPERM"), (("landlock",), "EPERM")],  # landlock: ABI 6 signal scope
)
def test_signalling_the_trainer(mechanisms, expected):
    if "uid" in mechanisms and not ROOT:
        pytest.skip("a throwaway uid needs root")
    if "landlock" in mechanisms and LANDLOCK < 6:
        pytest.skip(f"Landlock ABI {LANDLOCK} does not scope signals")
    assert run(signal_parent, None, mechanisms=mechanisms) == expected


def grandchild_setsid(_):
    """Whether a child of the sandboxed process can leave its process group."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os._exit(0)
        except OSError as e:
            os._exit(e.errno)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        raise OSError(code, "setsid")


def kill_everyone(_):
    os.kill(-1, 0)


def io_uring(_):
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(425, 1, params)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
    os.close(fd)


@needs_seccomp
def test_seccomp_keeps_descendants_in_the_group_and_refuses_escapes():
    assert run(grandchild_setsid, None) == "ok"
    assert run(grandchild_setsid, None, mechanisms=("seccomp",)) == "EPERM"
    assert run(kill_everyone, None, mechanisms=("seccomp",)) == "EPERM"
    assert run(io_uring, None, mechanisms=("seccomp",)) == "EPERM"  # io_uring would open sockets


def fork_many(n):
    """Fork up to n sleeping children; raise (EAGAIN, count) at the first refusal."""
    kids = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            kids.append(pid)
    except OSError as e:
        raise OSError(e.errno, f"after {len(kids)}") from None
    finally:
        for pid in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_the_process_limit_counts_the_sandbox_alone():
    """RLIMIT_NPROC counts per uid: a throwaway uid (root) counts only the sandbox; another user's
    limit is set above the processes it already runs; as root with neither the kernel never limits
    (the control)."""
    assert run(fork_many, 20, procs=8, mechanisms=("uid",)) == "EAGAIN"
    if ROOT:
        assert run(fork_many, 20, procs=8) == "ok"


def hog(mb):
    bytearray(mb << 20)


def test_memory_is_the_size_at_start_plus_memory_mb():
    assert run(hog, 64, memory_mb=256) == "ok"
    assert run(hog, 512, memory_mb=256) == "MemoryError"


def test_a_run_past_its_time_is_killed():
    t0 = time.monotonic()
    with pytest.raises(Contained, match=r"^timeout after 0.3s$"):
        run_isolated(time.sleep, (60,), SandboxConfig(), timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


@needs_seccomp
def test_processes_a_run_leaves_die_with_it():
    """Outside a worker the run leads its own process group, which seccomp keeps its descendants in."""
    comm = "tr-" + uuid.uuid4().hex[:10]
    assert run_isolated(leave_grandchild, (comm,), SandboxConfig(), timeout_s=10.0) == 1.0
    deadline = time.monotonic() + 5
    while marked(comm) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marked(comm) == []


def test_beside_other_threads_the_fork_server_starts_the_run():
    """Forked from a process where another thread runs, a child could wait forever on a lock that
    thread held (a multi-turn run's tools run in the driver's threads): the fork server forks it."""
    from tailrace.runtime.procs import context

    context()  # a fork server this test starts preloads what the runtime's does, for the tests after it
    got = {}

    def calls():
        got["may_fork"] = isolated.may_fork()
        got["value"] = run_isolated(json.loads, ("[1, 2]",), SandboxConfig(), timeout_s=30.0)
        for name, fn, args in (("timeout", time.sleep, (60,)), ("signal", os.abort, ())):
            try:
                run_isolated(fn, args, SandboxConfig(), timeout_s=0.5 if name == "timeout" else 30.0)
            except Contained as e:
                got[name] = str(e)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert got == {
        "may_fork": False,
        "value": [1, 2],
        "timeout": "timeout after 0.5s",
        "signal": "killed by SIGABRT",
    }


def test_a_threaded_process_is_refused(tmp_path):
    """seccomp and Landlock would bind the calling thread only: the other would run unconfined."""
    pid = os.fork()
    if pid == 0:
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        try:
            enter(SandboxConfig(), str(tmp_path))
        except RuntimeError as e:
            os._exit(0 if "single-threaded process, this one has 2 threads" in str(e) else 2)
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"procs": 0}, "sandbox procs=0: must be a whole number >= 1"),
        ({"memory_mb": 1.5}, "sandbox memory_mb=1.5: must be a whole number >= 1"),
        ({"mechanisms": ("netns", "chroot")}, "sandbox mechanisms ['chroot'] unknown; choose from netns"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}".replace("[", r"\[").replace("]", r"\]")):
        SandboxConfig(**kwargs)
