"""Where worker processes run and how published weights reach them: this machine (`LocalHosts`) or
a Ray cluster (runtime/ray_hosts.py).

Either gives the driver the same three things, so `Workers`, the driver's loop and the worker bodies
are one code for both: a seat per worker (`place`: cores to pin, torch threads; one trainer per
policy of the run, each by its worker name), the workers' torch
device (`device`), a started worker
(`start`: a process handle as runtime/health.py reads one, a connection speaking runtime/messages.py,
the counter its heartbeat moves), and a weights ring (`ring`: write / read / holds / slots, as
runtime/weights.py). Worker bodies are called `target(conn, counter, *args)`. Engines that join a
running job (runtime/join.py) find its desk where `desk` says, and the driver watches each one through
the handle `joined` makes of it.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from tailrace.config import RuntimeConfig
from tailrace.runtime.procs import context, placement, resolve_device


class Seat(NamedTuple):
    cores: tuple[int, ...]  # the cores the worker pins itself to; () = not pinned (Ray places it)
    threads: int  # its torch threads


@dataclass
class Started:
    proc: Any  # is_alive(), exitcode, kill(), join(timeout): a multiprocessing Process or alike
    conn: Any  # send / recv / poll / close, waitable by multiprocessing.connection.wait
    counter: Any  # `.value`: the worker's heartbeat count, as the driver sees it


class Hosts(Protocol):
    def place(
        self, trainers: Sequence[str], engines: int, engine_threads: int
    ) -> tuple[list[Seat], list[Seat]]:
        """Reserve a seat for each trainer (by its worker name: one per policy) and each engine (on Ray:
        the placement group); returns the trainers' seats in that order, then the engines'."""
        ...

    def trainer_seat(self, name: str, like: Seat) -> Seat:
        """A seat for the trainer `name` of a policy that joins the running job (`like`: the first
        policy's trainer seat)."""
        ...

    def release_trainer_seat(self, name: str) -> None:
        """The seat `trainer_seat` gave `name`, whose trainer did not start, back to the cluster."""
        ...

    def device(self, name: str) -> str:
        """The workers' torch device for the config's `device` (auto, cpu, cuda, cuda:N)."""
        ...

    def start(self, name: str, target: Callable[..., None], args: tuple) -> Started: ...

    def ring(self, layout: Any, slots: int, dtype: Any) -> Any:
        """The weights ring for a flat layout (model/flat.FlatWeights) holding `slots` versions in
        `dtype` (a writer's buffer is rounded to it)."""
        ...

    def desk(self) -> tuple[str, dict]:
        """Where the join desk listens, and what a joiner needs to know beyond it (join.json)."""
        ...

    def joined(self, arrival: Any) -> Any:
        """The process handle (as `Started.proc`) of an engine that joined (a runtime/join.Arrival)."""
        ...

    def close(self) -> None: ...


class LocalHosts:
    """One process per role on this machine, each pinned to its own cores (runtime/procs.py)."""

    def __init__(self) -> None:
        self.ctx = context()

    def place(
        self, trainers: Sequence[str], engines: int, engine_threads: int
    ) -> tuple[list[Seat], list[Seat]]:
        """Several policies' trainers share the trainer's cores (flow.share says how they take turns)."""
        train, cores = placement(engines)
        return [Seat(train, len(train))] * len(trainers), [Seat(c, engine_threads) for c in cores]

    def trainer_seat(self, name: str, like: Seat) -> Seat:
        return like  # the trainers' cores, shared

    def release_trainer_seat(self, name: str) -> None:
        pass

    def device(self, name: str) -> str:
        return resolve_device(name)

    def start(self, name: str, target: Callable[..., None], args: tuple) -> Started:
        conn, child = self.ctx.Pipe()
        counter = self.ctx.Value("Q", 0, lock=False)
        proc = self.ctx.Process(
            target=_exit_when_done,
            args=(target, Driver(), child, counter, *args),  # the driver's environment and output now
            name=name,
            daemon=True,
        )
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is the driver's
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, sigint)
        child.close()  # only the worker holds its end now: when it dies, ours reads end-of-file
        return Started(proc, conn, counter)

    def ring(self, layout: Any, slots: int, dtype: Any) -> Any:
        from tailrace.runtime.weights import SharedWeights

        return SharedWeights(layout.layout, layout.buffer.numel(), dtype, slots)

    def desk(self) -> tuple[str, dict]:
        from tailrace.runtime.join import LOOPBACK

        return LOOPBACK, {"runtime": "local"}

    def joined(self, arrival: Any) -> Any:
        from tailrace.runtime.join import JoinedProcess

        return JoinedProcess(arrival.pid, arrival.started)

    def close(self) -> None:
        pass


class Driver:
    """What a worker forked from the fork server (procs.context) takes of the driver as it starts,
    where a spawned one inherited it: the environment, stdout and stderr as they are now (a test's
    capture, a log file), and Ctrl-C left to the driver (SIGINT ignored)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # the fds travel with the start, as a Pipe's do

        return (_as_driver, (dict(os.environ), DupFd(1), DupFd(2)))


def _as_driver(env: dict[str, str], out: Any, err: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in ((1, out), (2, err)):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


def _exit_when_done(target: Callable[..., None], _driver: None, *args: Any) -> None:
    """Run a worker body (unpickling `_driver` already took the driver's environment and output), then
    leave without the interpreter's teardown: freeing a torch process's modules took 1-2 s of each
    run's end, and a worker has nothing left to clean up (its files are closed, its messages sent; the
    driver owns the shared memory)."""
    code = 0
    try:
        target(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 — outside `serving` (e.g. unpickling the arguments)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hosts_for(cfg: RuntimeConfig) -> Hosts:
    if cfg.kind == "ray":
        from tailrace.runtime.ray_hosts import RayHosts

        return RayHosts(cfg)
    return LocalHosts()
