"""The Ray runtime's hosts: the trainer and each engine as a Ray actor in one placement group.

Ray only places and starts the worker processes; everything after that is the local runtime's. Each
actor (`Host`) listens on a TCP port of its node, and the driver connects to it with
`multiprocessing.connection.Client` (authenticated by a key made for the run), so the worker body,
its typed messages (runtime/messages.py) and the driver's `Workers` are the ones of the local runtime.
Two things differ because a remote process shares no memory with the driver: the heartbeat travels
as `Beat` messages on a second connection, read by a thread of the driver (so it is heard whatever
the driver is reading), instead of a shared counter; and published weights go through the object
store (runtime/ray_weights.py), or by a collective beside it (runtime/ray_collective.py: each worker
started gets its own end of the group, `start`), instead of the shared-memory ring. A dead actor reads as a dead
process (its connection ends, its `run` call fails) and a stopped one as a silent one: `Workers`
finds both and the driver replaces them in the same bundle, as it does local workers.

Engines may also join a running Ray job as actors of their own (runtime/ray_join.py, the joiner's
side); `desk` tells them where, and `RayJoined` is how the driver watches one. This module and
ray_join.py import Ray, and only when a run asks for it (`import_ray`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing import current_process
from multiprocessing.connection import Client, Listener
from typing import Any, Callable, Sequence

from tailrace.common import ConfigError, Fault, one_line
from tailrace.config import RuntimeConfig
from tailrace.runtime.health import STARTUP_S, Beats, Heard
from tailrace.runtime.hosts import Seat, Started
from tailrace.runtime.procs import kill_process, started_at

LOOPBACK = "127.0.0.1"
PLACE_S = 120.0  # for the placement group's bundles to be reserved, once the cluster has the resources


def import_ray(address: str | None = None):
    """Ray, imported once a run asks for it. `address`: the cluster this process will connect to. On
    loopback, Ray is kept there: it rewrites a loopback address to this machine's interface address,
    where a cluster started on loopback does not listen (ray.init then retries for minutes), unless
    its cluster switch is off, which changes nothing else on Linux (this node's address is loopback)."""
    if address and address.rsplit(":", 1)[0] in (LOOPBACK, "localhost") and "ray" not in sys.modules:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "runtime.kind=ray needs Ray, which is not installed: pip install 'tailrace[ray]' "
            "(or use runtime.kind=local)"
        ) from None
    return ray


# -- the worker's side ---------------------------------------------------------------------------


class Host:
    """A Ray actor that runs one worker body, `target(conn, counter, *args)`, over a connection the
    driver opens to it; `run` returns when the body does."""

    def __init__(self, authkey: bytes) -> None:
        # on the address Ray knows its node by (loopback for a cluster started for the run); only a
        # holder of the run's key gets in
        self.listener = Listener((import_ray().util.get_node_ip_address(), 0), authkey=authkey)

    def address(self) -> tuple[str, int, int, str, int | None]:
        """(node ip, port, pid, node id, start time): where the driver connects, and what ends this
        process (procs.started_at)."""
        ray = import_ray()
        node = ray.get_runtime_context().get_node_id()
        return self.listener.address[0], self.listener.address[1], os.getpid(), node, started_at(os.getpid())

    def run(self, name: str, target: Callable[..., None], args: tuple) -> None:
        conn, beats = self.listener.accept(), self.listener.accept()  # the driver connects in this order
        self.listener.close()
        current_process().name = name  # the process calls itself tr-<name> (workers.serving)
        target(conn, Beats(beats), *args)


# -- the driver's side ---------------------------------------------------------------------------


class RayProcess:
    """A worker in a Ray actor, as the driver handles a process: alive while its `run` call is
    pending. `exitcode`: 0 when the body returned, 1 when it raised, None when the actor died (Ray
    does not say by which signal)."""

    def __init__(self, ray: Any, actor: Any, running: Any, pid: int, node: str, started: int | None) -> None:
        self.ray, self.actor, self.running, self.pid, self.node = ray, actor, running, pid, node
        self.started = started
        self.exitcode: int | None = None
        self.ended = False

    def is_alive(self) -> bool:
        if not self.ended and self.ray.wait([self.running], timeout=0, fetch_local=False)[0]:
            self.ended = True
            try:
                self.ray.get(self.running)
                self.exitcode = 0
            except self.ray.exceptions.RayActorError:
                self.exitcode = None
            except self.ray.exceptions.RayError:
                self.exitcode = 1
        return not self.ended

    def kill(self) -> None:
        _kill_actor(self.ray, self.actor, self.node, self.pid, self.started)

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.running], timeout=timeout, fetch_local=False)


class RayJoined:
    """An engine that joined the run as a Ray actor (runtime/ray_join.py), as the driver handles a
    process: the joiner's `tailrace engine join` owns the actor, the driver finds it by its name, and
    it is alive while Ray still knows that name (a dead actor's is released). Asked at most every
    `EVERY_S`: each answer is a call to Ray's control store."""

    EVERY_S = 0.5
    exitcode = None  # not the driver's to know

    def __init__(self, ray: Any, name: str, node: str, pid: int, started: int | None) -> None:
        self.ray, self.name, self.node, self.pid, self.started = ray, name, node, pid, started
        self._alive, self._asked = True, float("-inf")

    def is_alive(self) -> bool:
        if self._alive and time.monotonic() - self._asked >= self.EVERY_S:
            self._asked = time.monotonic()
            self._alive = self._actor() is not None
        return self._alive

    def kill(self) -> None:
        self._asked = float("-inf")  # Ray may have let the name go while the process is still there
        _kill_actor(self.ray, self._actor(), self.node, self.pid, self.started)

    def join(self, timeout: float | None = None) -> None:
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.05)

    def _actor(self) -> Any:
        from tailrace.runtime.ray_join import NAMESPACE

        try:
            return self.ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:  # no live actor of that name
            return None


def _kill_actor(ray: Any, actor: Any | None, node: str, pid: int, started: int | None) -> None:
    """`ray.kill` asks the actor to exit, which a stopped process never does (and its bundle stays
    held): a task on its node SIGKILLs the process as well. Always: Ray may already call the actor
    dead while its process is still there, stopped (a replacement then waited for the bundle)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if actor is not None:
        ray.kill(actor, no_restart=True)
    on_node = NodeAffinitySchedulingStrategy(node, soft=False)
    ray.remote(kill_process).options(num_cpus=0, scheduling_strategy=on_node).remote(pid, started)


class RayHosts:
    """Seats on a Ray cluster: bundles 0..P-1 of the placement group are the trainers' (one per policy,
    each with runtime.trainer_cpus / trainer_gpus), bundle P+i engine i's."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.ray = import_ray(cfg.address)
        self.authkey = os.urandom(32)
        self.owns_ray = False  # this run started Ray (and so shuts it down)
        self.group = None
        self.joined_groups: dict[str, Any] = {}  # a joining policy's trainer -> its own one-bundle group
        self.bundles: dict[str, tuple[int, float, float]] = {}  # worker name -> (bundle, CPUs, GPUs)
        self.trainers: list[str] = []  # their worker names, one per policy
        self.actors: list[Any] = []
        self.workers_device = "cpu"
        self.weights: Any = None  # the ring `ring` made
        self.started: set[str] = set()  # worker names started once (a later start is a replacement)

    def place(
        self, trainers: Sequence[str], engines: int, engine_threads: int
    ) -> tuple[list[Seat], list[Seat]]:
        ray, c = self.ray, self.cfg
        self._connect()
        trainer, engine = (
            {"CPU": c.trainer_cpus, "GPU": c.trainer_gpus},
            {"CPU": c.engine_cpus, "GPU": c.engine_gpus},
        )
        need = [trainer] * len(trainers) + [engine] * engines
        self._check_fits(need, len(trainers), engines)
        from ray.util.placement_group import placement_group

        self.group = placement_group([{k: v for k, v in b.items() if v} for b in need], strategy=c.strategy)
        try:
            ray.get(self.group.ready(), timeout=PLACE_S)
        except ray.exceptions.GetTimeoutError:
            raise Fault(
                f"runtime.strategy={c.strategy}: Ray placed no group of {_trainers(len(trainers))} and "
                f"{engines} engine(s) within {PLACE_S:.0f} s (nodes busy, or too few for a STRICT strategy)"
            ) from None
        self.trainers = list(trainers)
        names = [*trainers, *(f"engine{i}" for i in range(engines))]
        self.bundles = {name: (k, need[k]["CPU"], need[k]["GPU"]) for k, name in enumerate(names)}
        return [Seat((), int(c.trainer_cpus))] * len(trainers), [Seat((), engine_threads)] * engines

    def trainer_seat(self, name: str, like: Seat) -> Seat:
        """A seat for the trainer of a policy joining the running job: a placement group of its own (one
        trainer bundle), reserved now; refused in one line where the cluster has no room or the weights
        move by a collective (its members are fixed when the run starts)."""
        ray, c = self.ray, self.cfg
        if c.weights == "collective":
            raise ConfigError(
                "runtime.weights=collective: the collective's members are fixed when the run starts; "
                "policies join a Ray run whose weights move through the object store (runtime.weights=store)"
            )
        from ray.util.placement_group import placement_group, remove_placement_group

        need = {"CPU": c.trainer_cpus, "GPU": c.trainer_gpus}
        group = placement_group([{k: v for k, v in need.items() if v}])
        try:
            ray.get(group.ready(), timeout=PLACE_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise ConfigError(
                f"the Ray cluster has no room for another trainer ({c.trainer_cpus:g} CPU, {c.trainer_gpus:g} "
                f"GPU) within {PLACE_S:.0f} s; add a node (ray start --address) and join again"
            ) from None
        self.joined_groups[name] = group
        self.bundles[name] = (0, need["CPU"], need["GPU"])
        return Seat((), int(c.trainer_cpus))

    def release_trainer_seat(self, name: str) -> None:
        group = self.joined_groups.pop(name, None)
        self.bundles.pop(name, None)
        if group is not None:
            self.ray.util.remove_placement_group(group)

    def device(self, name: str) -> str:
        """The workers' torch device: cuda when every actor reserves a GPU (auto), else cpu; the driver
        may have no GPU of its own."""
        gpus = self.cfg.trainer_gpus > 0 and self.cfg.engine_gpus > 0
        if name == "auto":
            name = "cuda" if gpus else "cpu"
        elif name.startswith("cuda") and not gpus:
            raise ConfigError(
                f"device={name} with runtime.kind=ray: reserve GPUs for the actors (runtime.trainer_gpus=1 "
                "runtime.engine_gpus=1), or use device=cpu"
            )
        self.workers_device = name
        return name

    def start(self, name: str, target: Callable[..., None], args: tuple) -> Started:
        ray, c = self.ray, self.cfg
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if c.weights == "collective":  # each worker gets its own end of the group
            first = name not in self.started
            args = tuple(self.weights.end(name, first) if a is self.weights else a for a in args)
        self.started.add(name)
        index, cpus, gpus = self.bundles[name]
        actor = (
            ray.remote(Host)
            .options(
                num_cpus=cpus,
                num_gpus=gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.joined_groups.get(name, self.group), placement_group_bundle_index=index
                ),
            )  # fmt: skip
            .remote(self.authkey)
        )
        self.actors.append(actor)
        try:
            ip, port, pid, node, started = ray.get(actor.address.remote(), timeout=STARTUP_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise Fault(f"{name}: its Ray actor did not start ({one_line(e)})") from None
        running = actor.run.remote(name, target, args)
        conn = Client((ip, port), authkey=self.authkey)
        beats = Client((ip, port), authkey=self.authkey)
        return Started(RayProcess(ray, actor, running, pid, node, started), conn, Heard(beats))

    def ring(self, layout: Any, slots: int, dtype: Any) -> Any:
        """The object store (runtime/ray_weights.py), or a collective over it (runtime/ray_collective.py)."""
        from tailrace.runtime.ray_weights import StoreWeights

        self.weights = StoreWeights(self.ray, layout.layout, dtype, slots)
        if self.cfg.weights == "collective":
            from tailrace.runtime.ray_collective import Collective

            host, senders = self.ray.util.get_node_ip_address(), tuple(self.trainers)
            world = len(self.bundles) - len(senders) + 1  # a group: its trainer and every engine
            self.weights = Collective(
                self.weights, layout.buffer.numel(), host, world, self.workers_device, senders
            )
        return self.weights

    def desk(self) -> tuple[str, dict]:
        """On the address Ray knows the driver's node by (as `Host` listens), with the cluster's address
        and an engine actor's resources: a joiner starts its actor there (runtime/ray_join.py)."""
        c = self.cfg
        about = {
            "runtime": "ray", "ray_address": self.ray.get_runtime_context().gcs_address,
            "engine_cpus": c.engine_cpus, "engine_gpus": c.engine_gpus,
        }  # fmt: skip
        return self.ray.util.get_node_ip_address(), about

    def joined(self, arrival: Any) -> Any:
        # a plain process joined a Ray run (`tailrace engine join` always starts an actor there)
        if not arrival.actor:
            from tailrace.runtime.join import JoinedProcess

            return JoinedProcess(arrival.pid, arrival.started)
        return RayJoined(self.ray, arrival.actor, arrival.node, arrival.pid, arrival.started)

    def close(self) -> None:
        if not self.ray.is_initialized():
            return
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        for group in [self.group, *self.joined_groups.values()]:
            if group is not None:
                self.ray.util.remove_placement_group(group)
        if self.owns_ray:
            self.ray.shutdown()

    def _connect(self) -> None:
        ray, address = self.ray, self.cfg.address
        if ray.is_initialized():  # a caller's own Ray session (a notebook, the tests)
            return
        # ray.init makes SIGTERM exit at once with code 15; the run's own handler stops it as Ctrl-C does
        # (exit 143, "continue with --resume"), and the supervisor tells the two apart
        on_term = signal.getsignal(signal.SIGTERM)
        try:
            if address is None:  # a one-machine cluster for the run, on loopback only
                ray.init(include_dashboard=False, logging_level=logging.WARNING, _node_ip_address=LOOPBACK)
            else:
                ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(
                f"runtime.address={address}: no Ray cluster to join ({one_line(e)}); start one with "
                "`ray start --head`, or leave runtime.address null to start one for the run"
            ) from None
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_term)
        self.owns_ray = True

    def _check_fits(self, need: list[dict[str, float]], trainers: int, engines: int) -> None:
        """A cluster that cannot hold the group now is refused at once (no autoscaler is waited for)."""
        have = self.ray.cluster_resources()
        total = {k: sum(b[k] for b in need) for k in ("CPU", "GPU")}
        nodes = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
        fits_a_node = all(any(all(r.get(k, 0) >= v for k, v in b.items()) for r in nodes) for b in need)
        if fits_a_node and all(have.get(k, 0) >= v for k, v in total.items()):
            return
        c = self.cfg
        each = " each" if trainers > 1 else ""
        raise ConfigError(
            f"runtime: {_trainers(trainers)} (trainer_cpus={c.trainer_cpus:g}, trainer_gpus={c.trainer_gpus:g}"
            f"{each}) and {engines} engine(s) (engine_cpus={c.engine_cpus:g}, engine_gpus={c.engine_gpus:g} each) "
            f"need {total['CPU']:g} CPU(s) and {total['GPU']:g} GPU(s), each seat on one node; the Ray cluster has "
            f"{have.get('CPU', 0):g} CPU(s) and {have.get('GPU', 0):g} GPU(s) on {len(nodes)} node(s): lower "
            "runtime.*_cpus / *_gpus or rollout.engines, or add nodes (ray start --address=...)"
        )


def _trainers(n: int) -> str:
    return "the trainer" if n == 1 else f"{n} trainers (one per policy)"
