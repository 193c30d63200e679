"""An engine that joins a running Ray job as a Ray actor: `tailrace engine join RUN_DIR` where the run
has runtime.kind=ray.

The command reads the job's join.json (runtime/join.py: its desk's address, its cluster's address,
an engine actor's resources), connects to that cluster and starts a `Joiner` actor there with an
engine's resources (runtime.engine_cpus / engine_gpus), under a name the driver finds it by
(runtime/ray_hosts.RayJoined). From there the actor is a joined engine as runtime/join.py describes:
three connections to the desk, a `Welcome`, then the engine body, its weights sent by the driver over
its weights connection. The command owns the actor and waits on it: SIGTERM to the command asks the
job to let the engine go (its samples requeued), and if the command dies the actor dies with it and
the driver removes the engine the same way.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from tailrace.common import Fault, InputError, one_line
from tailrace.runtime.join import introduce, leave, serve
from tailrace.runtime.ray_hosts import import_ray

NAMESPACE = "tailrace-join"  # joiners' actors are named in it, so the driver can look them up
PLACE_S = 120.0  # for the cluster to place the actor and the job to welcome it


class Joiner:
    """A Ray actor that joins the job's desk (`hello`, which returns its engine id) and then works as
    that engine until the job ends or lets it go (`serve`)."""

    def hello(self, addr: tuple[str, int], key: bytes, cores: tuple[int, ...], name: str, what: str) -> int:
        node = import_ray().get_runtime_context().get_node_id()
        self.conns, self.welcome = introduce(addr, key, cores, what, actor=name, node=node)
        return self.welcome.engine

    def serve(self) -> None:
        serve(self.conns, self.welcome)


def join_on_ray(run_dir: Path, where: dict, key: bytes, cores: tuple[int, ...]) -> int:
    """Join the Ray job running in `run_dir` (`where`: its join.json) with a `Joiner` actor; returns
    when the engine has left (0) or its actor died (1)."""
    ray = import_ray(where["ray_address"])
    try:
        ray.init(address=where["ray_address"], namespace=NAMESPACE, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise InputError(
            f"{run_dir}: its job's Ray cluster at {where['ray_address']} does not answer ({one_line(e)})"
        ) from None
    name = f"engine-join-{os.getpid()}-{os.urandom(3).hex()}"
    cpus, gpus = where["engine_cpus"], where["engine_gpus"]
    free = ray.available_resources()
    if free.get("CPU", 0) < cpus or free.get("GPU", 0) < gpus:  # said now, not after the wait
        print(
            f"waiting up to {PLACE_S:.0f} s for a seat: the cluster has {free.get('CPU', 0):g} CPUs and "
            f"{free.get('GPU', 0):g} GPUs free, an engine actor takes {cpus:g} and {gpus:g} (add a node: "
            f"ray start --address={where['ray_address']})",
            flush=True,
        )
    actor = ray.remote(Joiner).options(name=name, num_cpus=cpus, num_gpus=gpus, max_restarts=0).remote()
    hello = actor.hello.remote((where["host"], int(where["port"])), key, cores, name, str(run_dir))
    try:
        engine = ray.get(hello, timeout=PLACE_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        raise Fault(
            f"{run_dir}: no engine actor (engine_cpus={cpus:g}, engine_gpus={gpus:g}) joined within "
            f"{PLACE_S:.0f} s: the cluster has no free seat for one (add a node: ray start --address=...)"
        ) from None
    except ray.exceptions.RayTaskError as e:
        raise Fault(f"{run_dir}: the engine actor could not join ({one_line(e.cause)})") from None
    except ray.exceptions.RayError as e:  # its cluster went down before it joined: the run ended?
        ended = "" if (run_dir / "join.json").exists() else "the run ended first; "
        raise Fault(f"{run_dir}: the engine actor died before it joined ({ended}{one_line(e)})") from None
    print(f"joined {run_dir} as engine {engine} (Ray actor {name})", flush=True)

    def on_term(signum, frame) -> None:
        try:
            leave(run_dir, engine)
        except InputError:  # the run is over: nothing to leave
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in its terminal: leave with SIGTERM instead
    serving = actor.serve.remote()
    while not ray.wait([serving], timeout=0.5)[0]:  # in short waits, so SIGTERM's handler gets to run
        pass
    try:
        ray.get(serving)
    except ray.exceptions.RayError as e:
        print(f"engine {engine}'s actor ended: {one_line(e)}", flush=True)
        return 1
    print(f"engine {engine} left {run_dir}", flush=True)
    return 0
