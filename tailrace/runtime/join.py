"""Engines that join a running job from outside it, and leave it: `tailrace engine join RUN_DIR`,
`tailrace engine leave RUN_DIR ENGINE_ID` (or SIGTERM to a joined process). Policies join and leave
through the same desk (runtime/policy_join.py): a `PolicyJoin` or `PolicyLeave` on a connection the
driver answers on once it has handled it.

The driver opens a desk (`Desk`): a listener authenticated by a key made for the run, on loopback
(on Ray: on the address Ray knows the driver's node by, as its actors listen); the address goes to
RUN_DIR/join.json and the key to RUN_DIR/join.key, both mode 0600, so only the run's owner can add
or remove engines. A joining process (`join`; on a Ray job, a Ray actor it starts on the job's
cluster: runtime/ray_join.py) opens three connections, each introduced by a `Hello(pid, role)`: its
messages (runtime/messages.py, as any worker's), its heartbeat (`Beat`s, as a Ray actor's:
runtime/ray_hosts.py) and its weights. The driver registers it with the scheduler (a new engine id,
holding no weights: `Scheduler.add_engine`), answers with a `Welcome` (its id and the run's engine
spec), and from then on it is a worker like the others. Until it says `Ready` (its engine built: a
vLLM engine takes seconds) it is booked as starting and gets no order, so it is never asked for
weights the ring replaces meanwhile; then the scheduler has it load the weights its policy needs,
then gives it work.

It was not forked from the driver, so it shares no memory with the weights ring: it asks for a
version on its weights connection and a driver thread answers with that ring slot, one contiguous
buffer in one message (`WireWeights`; a few MB for the built-in model).

A `Leave(engine)` on a connection of its own asks the driver to remove an engine, joined or not: the
scheduler requeues its in-flight samples (`Scheduler.remove_engine`) and the worker is told to shut
down; the driver handles joins and leaves between polls of the training loop, never during an
evaluation.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError, Pipe, current_process
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from tailrace.common import Fault, InputError, one_line
from tailrace.runtime.procs import kill_process, started_at, stat_fields
from tailrace.runtime.weights import Torn, VersionGone

LOOPBACK = "127.0.0.1"
ROLES = ("messages", "beats", "weights")  # a joiner's connections, opened in this order
HELLO_S = 10.0  # for a connection's first message


@dataclass(frozen=True)
class Hello:
    pid: int
    role: str  # one of ROLES
    cores: tuple[int, ...] = ()  # the cores it asks to be pinned to (messages only; (): the driver picks)
    actor: str = ""  # a Ray actor's name (runtime/ray_join.py), by which the driver finds it; "" = a process
    node: str = ""  # that actor's Ray node id
    started: int | None = None  # when its process started (procs.started_at): with the pid, which process


@dataclass(frozen=True)
class Leave:
    engine: int


@dataclass(frozen=True)
class PolicyJoin:
    """A policy joins the run (runtime/policy_join.py): its entry of the run's policies list."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class PolicyLeave:
    name: str


@dataclass(frozen=True)
class Asked:
    """A policy's join or leave, and the connection its answer goes back on."""

    msg: PolicyJoin | PolicyLeave
    conn: Connection

    def answer(self, ok: bool, line: str) -> None:
        try:
            self.conn.send((ok, line))
        except OSError:  # the asker gave up waiting: the run's records say what happened
            pass
        self.conn.close()


@dataclass(frozen=True)
class Welcome:
    engine: int
    spec: Any  # runtime/engine_worker.EngineSpec
    layout: Any  # model/flat.Layout
    dtype: Any  # the ring's torch dtype


@dataclass(frozen=True)
class Arrival:
    """A joining process, its three connections open."""

    pid: int
    conns: dict[str, Connection]
    cores: tuple[int, ...]  # asked for; () = the driver picks
    actor: str = ""  # a Ray actor's name; "" = a process on this machine
    node: str = ""  # the actor's Ray node id
    started: int | None = None  # when its process started (procs.started_at)


# -- the driver's side ---------------------------------------------------------------------------


def listen(run_path: Path, name: str, host: str = LOOPBACK, about: dict | None = None) -> Listener:
    """A listener authenticated by a key made for it: its address (and `about`) in RUN/<name>.json, the
    key in RUN/<name>.key, both 0600, so only the run's owner can connect."""
    key = os.urandom(32)
    listener = Listener((host, 0), authkey=key)
    host, port = listener.address
    write_private(run_path / f"{name}.key", key)
    write_private(run_path / f"{name}.json", json.dumps({"host": host, "port": port, "pid": os.getpid(),
                                                         **(about or {})}).encode())  # fmt: skip
    return listener


def unlisten(listener: Listener, run_path: Path, name: str) -> None:
    """Close a `listen` listener and remove its files. A thread blocked in its `accept` is woken first
    (shutdown): closing alone leaves it blocked on the still-bound socket for good, a thread and a
    port leaked for each ended run in a process that lives on (a notebook, the tests)."""
    sock = getattr(getattr(listener, "_listener", None), "_socket", None)  # multiprocessing's SocketListener
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected: nothing blocked on it
            pass
    listener.close()
    for f in (f"{name}.json", f"{name}.key"):
        (run_path / f).unlink(missing_ok=True)


class Desk:
    """The driver's listener for engines that join or leave (`take` between polls). `host`: the address
    it listens on (loopback locally; on Ray the address Ray knows the driver's node by); `about`: what
    else a joiner needs to know, written to join.json beside the address (`runtime`: local or ray)."""

    def __init__(self, run_path: Path, host: str = LOOPBACK, about: dict | None = None) -> None:
        self.run_path = run_path
        self.listener = listen(run_path, "join", host, {"runtime": "local", **(about or {})})
        self.waitable, self._wake = Pipe(duplex=False)  # readable when something arrived
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._parts: dict[int, dict[str, Connection]] = {}
        self._hellos: dict[int, Hello] = {}  # each joiner's messages Hello: its cores, actor and node
        self._closed = False
        threading.Thread(target=self._accept, name="join-desk", daemon=True).start()

    def take(self) -> list[Arrival | Leave | Asked]:
        while self.waitable.poll():
            self.waitable.recv_bytes()
        got = []
        while not self._arrived.empty():
            got.append(self._arrived.get())
        return got

    def close(self) -> None:
        self._closed = True
        unlisten(self.listener, self.run_path, "join")

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except AuthenticationError:  # not the run's key: refused
                continue
            except OSError:  # closed
                return
            try:
                msg = conn.recv() if conn.poll(HELLO_S) else None
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, Leave):
                conn.close()
                self._arrive(msg)
            elif isinstance(msg, (PolicyJoin, PolicyLeave)):
                self._arrive(Asked(msg, conn))  # answered by the driver, between polls
            elif isinstance(msg, Hello) and msg.role in ROLES:
                parts = self._parts.setdefault(msg.pid, {})
                parts[msg.role] = conn
                if msg.role == "messages":
                    self._hellos[msg.pid] = msg
                if len(parts) == len(ROLES):
                    h = self._hellos.pop(msg.pid)
                    self._arrive(
                        Arrival(msg.pid, self._parts.pop(msg.pid), h.cores, h.actor, h.node, h.started)
                    )
            else:
                conn.close()

    def _arrive(self, what: Arrival | Leave | Asked) -> None:
        self._arrived.put(what)
        self._wake.send_bytes(b"!")


def serve_weights(conn: Connection, weights: Any) -> None:
    """Answer a joined engine's weight requests (a version each) with that version's buffer, as raw
    bytes; an empty answer when the ring no longer holds it. Runs in a thread until the engine goes."""

    def run() -> None:
        while True:
            try:
                v = conn.recv()
            except (EOFError, OSError):
                return
            try:
                flat = weights.read(v)
                data = memoryview(flat.buffer.contiguous().view(-1).view(_uint8()).numpy())
            except RuntimeError:
                flat, data = None, b""
            try:
                conn.send_bytes(data)
                if flat is not None:  # whether the slot still held v once sent (WireWeights.read)
                    conn.send_bytes(b"1" if weights.intact(v, flat) else b"0")
            except OSError:
                return

    threading.Thread(target=run, name="join-weights", daemon=True).start()


class JoinedProcess:
    """A joined engine's process as the driver handles one (runtime/health.py): not its child, so
    alive while its pid is (and not a zombie), and while that pid is still the process that joined
    (`started`, procs.started_at; None: not known); its exit code is not the driver's to know."""

    exitcode = None

    def __init__(self, pid: int, started: int | None = None) -> None:
        self.pid, self.started = pid, started

    def is_alive(self) -> bool:
        try:
            fields = stat_fields(self.pid)
            return fields[0] != "Z" and self.started in (None, int(fields[19]))
        except (FileNotFoundError, IndexError):
            return False
        except OSError:  # no /proc: ask the kernel
            try:
                os.kill(self.pid, 0)
                return True
            except OSError:
                return False

    def kill(self) -> None:
        kill_process(self.pid, self.started)

    def join(self, timeout: float | None = None) -> None:
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.05)


# -- the joining process's side ------------------------------------------------------------------


class WireWeights:
    """A joined engine's weights reader (read / arrivals, as runtime/weights.SharedWeights): each
    version comes from the driver's ring over the weights connection."""

    def __init__(self, conn: Connection, layout: Any, dtype: Any) -> None:
        self.conn, self.layout, self.dtype = conn, layout, dtype

    def read(self, version: int):
        import torch

        from tailrace.model.flat import FlatWeights

        self.conn.send(version)
        data = self.conn.recv_bytes()
        if not data:
            raise VersionGone(f"the driver's ring no longer holds the weights of version {version}")
        if self.conn.recv_bytes() != b"1":
            raise Torn(f"the driver's ring slot of version {version} was overwritten while it was sent")
        return FlatWeights(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype), self.layout)

    def arrivals(self) -> list:
        return []

    def intact(self, version: int, flat: Any) -> bool:
        """Always: `read` returns this process's own copy (the driver said whether the slot held)."""
        return True


def address(run_dir: Path) -> tuple[dict, bytes]:
    """What a running job's join.json says (where its desk listens, its runtime) and its key: bad input
    when the run is not running."""
    try:
        where = json.loads((run_dir / "join.json").read_text())
        key = (run_dir / "join.key").read_bytes()
    except FileNotFoundError:
        raise InputError(
            f"{run_dir}: no running job there (no join.json); start one with tailrace train "
            "(runtime.kind=local or ray), or pass its run directory"
        ) from None
    except (OSError, ValueError) as e:
        raise InputError(f"{run_dir}: cannot read its join.json / join.key ({one_line(e)})") from None
    return where, key


def dial(addr: tuple[str, int], key: bytes, what: str) -> Connection:
    try:
        return Client(addr, authkey=key)
    except (ConnectionRefusedError, AuthenticationError, OSError) as e:
        raise InputError(f"{what}: its job does not answer at {addr[0]}:{addr[1]} ({one_line(e)})") from None


def connect(run_dir: Path) -> Connection:
    where, key = address(run_dir)
    return dial((where["host"], int(where["port"])), key, str(run_dir))


def leave(run_dir: Path, engine: int) -> None:
    """Ask the job running in `run_dir` to remove `engine` (it leaves once the driver reads this)."""
    with connect(run_dir) as conn:
        conn.send(Leave(engine))


def join(run_dir: Path, cores: tuple[int, ...] = ()) -> int:
    """Join the job running in `run_dir` as a new engine and serve it until the run ends or the engine
    is told to leave (SIGTERM: this process asks to leave, and exits when the driver lets it go).
    `cores`: pin it there (default: a core no worker of the run uses, else the run's engines'). A job on
    Ray is joined by a Ray actor this process starts on its cluster (runtime/ray_join.py)."""
    where, key = address(run_dir)
    if where.get("runtime") == "ray":
        from tailrace.runtime.ray_join import join_on_ray

        return join_on_ray(run_dir, where, key, cores)
    conns, welcome = introduce((where["host"], int(where["port"])), key, cores, str(run_dir))
    print(f"joined {run_dir} as engine {welcome.engine} (pid {os.getpid()})", flush=True)

    def on_term(signum, frame) -> None:
        try:
            leave(run_dir, welcome.engine)  # on a connection of its own: the loop's is the engine's
        except InputError:  # the run is over: nothing to leave
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in its terminal: leave with SIGTERM instead
    serve(conns, welcome)
    print(f"engine {welcome.engine} left {run_dir}", flush=True)
    return 0


def introduce(
    addr: tuple[str, int], key: bytes, cores: tuple[int, ...], what: str, actor: str = "", node: str = ""
) -> tuple[dict[str, Connection], Welcome]:
    """Open the three connections to the desk at `addr` and wait for the job's `Welcome`."""
    pid = os.getpid()
    conns = {}
    for role in ROLES:
        conns[role] = dial(addr, key, what)
        conns[role].send(Hello(pid, role, cores, actor, node, started_at(pid)))
    welcome = conns["messages"].recv()
    if not isinstance(welcome, Welcome):
        raise Fault(f"{what}: the job answered {type(welcome).__name__}, not Welcome")
    return conns, welcome


def serve(conns: dict[str, Connection], welcome: Welcome) -> None:
    """Work as engine `welcome.engine` until the job ends or tells it to leave."""
    from tailrace.runtime.engine_worker import engine_main
    from tailrace.runtime.health import Beats

    current_process().name = f"engine{welcome.engine}"
    weights = WireWeights(conns["weights"], welcome.layout, welcome.dtype)
    engine_main(conns["messages"], Beats(conns["beats"]), welcome.engine, welcome.spec, weights)


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (created 0600, never readable by others first), whole: a
    reader polling for it sees it complete or not at all (built aside, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _uint8():
    import torch

    return torch.uint8
