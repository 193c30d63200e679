"""The Ray runtime (`runtime.kind=ray`) on a real local Ray cluster: a run trains with its trainer
and engine as Ray actors and its weights through the object store, or by a collective to the same
step records, the ledger exact; a stopped or killed engine actor is found and replaced as a local
worker is; bad input is one line."""

import contextlib
import dataclasses
import io
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tailrace.records import Span, StepRecord, read_events, read_metrics
from tests.runtime.conftest import TINY_RUN, assert_exact, one_line, recoveries, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # on loopback: the cluster's processes and the driver's connections never leave this machine
    # 3 CPUs: two policies' trainers and an engine, one CPU each
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    yield ray
    ray.shutdown()


def refuse_local_hosts(mp: pytest.MonkeyPatch) -> None:
    """The local runtime's process start and shared-memory ring fail: what runs, runs on Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("the local runtime was used")

    mp.setattr("tailrace.runtime.hosts.LocalHosts.start", refuse)
    mp.setattr("tailrace.runtime.weights.SharedWeights.__init__", refuse)


@pytest.fixture
def no_local_hosts(monkeypatch):
    refuse_local_hosts(monkeypatch)


def ray_argv(tiny_model, run_dir) -> list[str]:
    """A TINY_RUN on the Ray runtime, in sync: runs are compared record for record (the reproducible mode)."""
    return [
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--runtime.kind=ray",
        "--flow.mode=sync",
    ]  # fmt: skip


def train(capsys, tiny_model, run_dir, *extra):
    return run(capsys, *ray_argv(tiny_model, run_dir), "--train.loss.kl_coef=0.01", *extra)


def steps_of(run_dir: Path) -> list[StepRecord]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]


def spans_of(run_dir: Path, phase: str) -> list[Span]:
    return [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, Span) and e.phase == phase]


@pytest.fixture(scope="module")
def store_run(ray_cluster, tiny_model, tmp_path_factory) -> tuple[int, str, Path]:
    """The 4-step run with weights through the object store and the local runtime disabled (rc,
    output, run directory): one run for the tests that check it and compare with it."""
    run_dir = tmp_path_factory.mktemp("store") / "run"
    argv = ray_argv(tiny_model, run_dir)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        refuse_local_hosts(mp)
        from tailrace.cli import main

        rc = main([*argv, "--train.loss.kl_coef=0.01"])
    return rc, out.getvalue(), run_dir


def test_a_ray_run_trains_and_times_every_weight_transfer(store_run):
    """Sync mode publishes a version after every step; each is put into the object store by the
    trainer actor and loaded by the engine actor, both timed, and the final evaluation runs on the
    last one. The KL penalty makes every step move the weights."""
    rc, out, run_dir = store_run
    assert rc == 0, out
    assert "Traceback" not in out
    assert_exact(run_dir, steps=4)
    steps = steps_of(run_dir)
    assert [r.version for r in steps] == [1, 2, 3, 4]
    assert all(r.time["weight_sync_s"] > 0 for r in steps)
    spans = spans_of(run_dir, "sync")
    for lane in ("trainer", "engine0"):
        timed = {s.version: s.t1 - s.t0 for s in spans if s.lane == lane}
        assert set(timed) == {1, 2, 3, 4}, (lane, timed)
        assert all(dt > 0 for dt in timed.values())
    assert spans_of(run_dir, "receive") == []  # the object store has no receive of its own
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if type(r).__name__ == "EvalRecord"]
    assert [(e.tag, e.version) for e in evals] == [("base", 0), ("final", 4)]


def test_a_collective_run_times_every_transfer_and_equals_the_object_store_run(
    store_run, no_local_hosts, tiny_model, tmp_path, capsys
):
    """The same run with `runtime.weights=collective`: each version is broadcast by the trainer actor
    and received by the engine actor's thread (a `receive` span per version, which only the
    collective writes), then loaded from the engine's own ring; the trainer's send and the engine's
    load are timed as the object store's are, and every step record is the object-store run's but
    for `time` (a seeded sync run does not depend on how its weights travel)."""
    rc, out = train(capsys, tiny_model, tmp_path / "run", "--runtime.weights=collective")
    assert rc == 0, out
    assert "Traceback" not in out
    assert_exact(tmp_path / "run", steps=4)
    steps = steps_of(tmp_path / "run")
    assert all(r.time["weight_sync_s"] > 0 for r in steps)
    for phase, lane in (("sync", "trainer"), ("sync", "engine0"), ("receive", "engine0")):
        timed = {s.version: s.t1 - s.t0 for s in spans_of(tmp_path / "run", phase) if s.lane == lane}
        assert set(timed) == {1, 2, 3, 4}, (phase, lane, timed)
        assert all(dt > 0 for dt in timed.values())
    untimed = [dataclasses.replace(r, time={}) for r in steps]
    assert untimed == [dataclasses.replace(r, time={}) for r in steps_of(store_run[2])]


def engine_pid(name: str, timeout: float = 60) -> int:
    """The pid of this test's Ray actor calling itself tr-<name>: a descendant of this process (its
    raylet's child), never another run's worker on the machine."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for d in Path("/proc").iterdir():
            try:
                if (
                    d.name.isdigit()
                    and (d / "comm").read_text().strip() == f"tr-{name}"
                    and descends(int(d.name))
                ):
                    return int(d.name)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no tr-{name} process within {timeout} s")


def descends(pid: int) -> bool:
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if pid == os.getpid():
            return True
    return False


def when_steps(run_dir: Path, n: int, act, ended: threading.Event) -> threading.Thread:
    """Call `act()` once the run has written `n` step records, unless it `ended` first (in a thread:
    the run is this process)."""

    def wait():
        while not ended.is_set():
            f = run_dir / "metrics.jsonl"
            if f.exists() and f.read_text().count('"kind":"step"') >= n:
                return act()
            time.sleep(0.05)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def test_a_stopped_then_a_killed_engine_actor_is_replaced_and_the_run_ends_exact(
    ray_cluster, tiny_model, tmp_path, capsys
):
    """The engine actor stopped (SIGSTOP) after step 2: its heartbeat messages stop, it is found stuck
    after worker_timeout_s, killed and replaced in its bundle; the replacement killed (SIGKILL) after
    step 5: found dead by its connection, replaced again. Every step once, the ledger exact."""
    run_dir, hits, ended = tmp_path / "run", [], threading.Event()

    def hit(sig):
        pid = engine_pid("engine0")
        os.kill(pid, sig)
        hits.append((pid, sig))

    stop = when_steps(run_dir, 2, lambda: hit(signal.SIGSTOP), ended)
    kill = when_steps(run_dir, 5, lambda: hit(signal.SIGKILL), ended)
    try:
        rc, out = train(capsys, tiny_model, run_dir, "--flow.steps=8", "--worker_timeout_s=4", "--eval.n=8")
    finally:
        ended.set()
        for pid, _ in hits:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
    stop.join(), kill.join()
    assert rc == 0, out
    assert [s for _, s in hits] == [signal.SIGSTOP, signal.SIGKILL] and hits[0][0] != hits[1][0]
    got = [(m.data["worker"], m.data["cause"]) for m in recoveries(run_dir)]
    assert got == [("engine0", "stuck"), ("engine0", "died")], out
    assert "engine0 process is stuck: no heartbeat for" in recoveries(run_dir)[0].data["detail"]
    assert out.count("recovered: engine0") == 2
    assert_exact(run_dir, steps=8)


def test_without_ray_installed_the_run_says_how_to_install_it(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    rc, out = train(capsys, tiny_model, tmp_path / "run")
    assert rc == 2
    assert "pip install 'tailrace[ray]'" in one_line(out)


def test_a_cluster_too_small_for_the_seats_is_one_line(ray_cluster, tiny_model, tmp_path, capsys):
    rc, out = train(capsys, tiny_model, tmp_path / "run", "--runtime.engine_cpus=4")
    line = one_line(out)
    assert rc == 2
    assert "the trainer (trainer_cpus=1" in line and "need 5 CPU(s)" in line and "has 3 CPU(s)" in line
    assert "runtime.*_cpus" in line
    rc, out = train(
        capsys, tiny_model, tmp_path / "two", "--runtime.trainer_cpus=2", f"--policies={POLICIES}"
    )
    line = one_line(out)
    assert rc == 2
    assert "2 trainers (one per policy) (trainer_cpus=2, trainer_gpus=0 each)" in line
    assert "need 5 CPU(s)" in line and "has 3 CPU(s)" in line


POLICIES = "[{name: a}, {name: b, task: {seed: 3}, flow: {mode: multiversion}}]"


def test_two_policies_train_on_ray_each_trainer_an_actor_in_a_bundle_of_its_own(
    ray_cluster, no_local_hosts, tiny_model, tmp_path, capsys
):
    """Two policies (a sync, b multiversion) share the engine actor; each trainer is an actor of its own
    (trainer-a, trainer-b), in its own bundle with runtime.trainer_cpus. Their versions sit side by side
    in the ring, and each trainer broadcasts by a collective group of its own (the engine in both; the
    object store path is the one-policy tests' with the same bundles). Both finish every step once,
    their ledgers exact, each trainer publishing its own versions.

    b is trained by a trainer of one's own (train.external): trainer-b is its relay, listening where the
    driver reached it (this cluster's node: loopback), and tests/runtime/plain_trainer.py joins it by
    RUN/policies/b/trainer.json; its weights reach the engine by the collective as trainer-a's do."""
    import json
    import subprocess

    run_dir = tmp_path / "run"
    b_dir = run_dir / "policies" / "b"
    mine = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.plain_trainer", str(b_dir)], cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: list[dict] = []

    def watch():  # the relay's address, while the run lasts
        while mine.poll() is None and not seen:
            with contextlib.suppress(OSError, ValueError):
                seen.append(json.loads((b_dir / "trainer.json").read_text()))
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    policies = POLICIES.replace("mode: multiversion}", "mode: multiversion}, train: {external: true}")
    rc, out = train(
        capsys, tiny_model, run_dir, "--flow.steps=3", "--eval.n=4", "--runtime.weights=collective",
        f"--policies={policies}",
    )  # fmt: skip
    said, _ = mine.communicate(timeout=60)
    assert rc == 0 and mine.returncode == 0, (out[-3000:], said)
    assert "Traceback" not in out
    assert "end steps_done=3 finished=True" in said, said
    assert seen and seen[0]["host"] == "127.0.0.1", seen
    for name in ("a", "b"):
        assert_exact(run_dir / "policies" / name, steps=3)
        mine = steps_of(run_dir / "policies" / name)
        published = {s.version for s in spans_of(run_dir, "sync") if s.lane == f"trainer-{name}"}
        assert published and max(published) == mine[-1].version, (name, published)
    assert {s.lane for s in spans_of(run_dir, "train")} == {"trainer-a", "trainer-b"}
    loaded = {s.version for s in spans_of(run_dir, "sync") if s.lane == "engine0"}
    assert {v % 2 for v in loaded} == {0, 1}  # engine versions: policy p's are p mod 2
    received = {s.version for s in spans_of(run_dir, "receive")}
    assert {v % 2 for v in received} == {0, 1}, received  # one group per trainer, the engine in both


def test_an_engine_killed_in_a_collective_run_is_replaced_and_the_run_ends_exact(
    ray_cluster, tiny_model, tmp_path, capsys
):
    """The engine actor SIGKILLed after step 2 of 4 of a collective run: the driver replaces it (a
    replacement cannot join the group and reads the object store) and the trainer's next broadcast
    finds the member gone, ends the group and carries on through the object store. Every step once,
    the ledger exact; the versions received before the kill were received by the collective, none
    after it was."""
    run_dir, hits, ended = tmp_path / "run", [], threading.Event()

    def hit():
        pid = engine_pid("engine0")
        os.kill(pid, signal.SIGKILL)
        hits.append(pid)

    kill = when_steps(run_dir, 2, hit, ended)
    try:
        rc, out = train(
            capsys, tiny_model, run_dir, "--flow.steps=4", "--eval.n=8", "--runtime.weights=collective"
        )
    finally:
        ended.set()
    kill.join()
    assert rc == 0, out
    assert len(hits) == 1
    assert [(m.data["worker"], m.data["cause"]) for m in recoveries(run_dir)] == [("engine0", "died")], out
    assert_exact(run_dir, steps=4)
    received = sorted(s.version for s in spans_of(run_dir, "receive"))
    assert received in ([1], [1, 2])  # version 2's receive may have died unreported with the actor
    loaded = {s.version for s in spans_of(run_dir, "sync") if s.lane == "engine0"}
    assert loaded >= {3, 4}  # by the replacement, from the object store


def test_a_collective_without_ray_is_one_line_naming_the_fix(tiny_model, tmp_path, capsys):
    argv = ["train", f"--run-dir={tmp_path / 'run'}", f"--model.path={tiny_model}", *TINY_RUN]
    rc, out = run(capsys, *argv, "--runtime.weights=collective")
    assert rc == 2
    assert "runtime.weights=collective needs runtime.kind=ray" in one_line(out)
    assert "--runtime.kind=ray" in one_line(out)


def end_actor():
    """A class for a Ray actor holding one worker's end of a collective, as a trainer or engine actor
    would (made here, so Ray ships it by value: workers need not import the tests)."""

    class End:
        def __init__(self, end) -> None:
            self.end = end

        def pid(self) -> int:
            return os.getpid()

        def write(self, version: int, value: float, numel: int) -> None:
            import torch

            self.end.write(version, torch.full((numel,), value))

        def arrived(self) -> list[int]:
            return [v for v, _, _ in self.end.arrivals()]

        def read(self, version: int) -> float:
            return float(self.end.read(version).buffer.mean())

        def in_group(self) -> bool:
            return self.end.group is not None

    return End


def test_a_stopped_member_holds_a_broadcast_only_until_it_is_killed(ray_cluster):
    """A broadcast to an engine whose process is stopped waits (the ack never comes) and ends, with
    the version in the object store, as soon as the process is killed (as the driver kills a stuck
    worker); the trainer then publishes through the object store alone, without waiting."""
    import torch

    from tailrace.model.flat import FlatWeights
    from tailrace.runtime.ray_collective import Collective
    from tailrace.runtime.ray_weights import StoreWeights

    ray, numel = ray_cluster, 1 << 20
    store = StoreWeights.like(ray, FlatWeights(torch.zeros(numel), (("w", (numel,), 0),)), slots=3)
    coll = Collective(store, numel, "127.0.0.1", 2, "cpu")
    actor = ray.remote(end_actor()).options(num_cpus=0)
    trainer, engine = actor.remote(coll.end("trainer", True)), actor.remote(coll.end("engine0", True))
    deadline = time.time() + 60
    while not ray.get(trainer.in_group.remote()):  # the group forms in each member's thread
        assert time.time() < deadline, "no group within 60 s"
        time.sleep(0.05)
    ray.get(trainer.write.remote(1, 1.0, numel))
    assert ray.get(engine.arrived.remote()) == [1] and ray.get(engine.read.remote(1)) == 1.0
    pid = ray.get(engine.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        sending = trainer.write.remote(2, 2.0, numel)
        assert ray.wait([sending], timeout=2.0)[1] == [sending]  # held by the stopped member
    finally:
        os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    ray.get(sending, timeout=30)
    assert time.time() - t0 < 10
    assert coll.read(2).buffer.mean().item() == 2.0
    assert not ray.get(trainer.in_group.remote())
    ray.get(trainer.write.remote(3, 3.0, numel), timeout=10)
    assert coll.read(3).buffer.mean().item() == 3.0
    ray.kill(trainer)


def test_a_stopped_actor_is_killed_though_ray_already_calls_it_dead(ray_cluster):
    """`ray.kill` cannot end a stopped process, whose bundle then stays held, so the driver SIGKILLs
    the pid as well. It did so only while the actor still looked alive, and under load Ray may mark
    it dead first: the process stayed, stopped, and the replacement waited 300 s for its CPU (seen
    once in a loaded run). Now the SIGKILL goes whatever Ray says, and the CPU comes back."""
    from tailrace.runtime.ray_hosts import Host, RayProcess

    ray = ray_cluster
    cpus = ray.available_resources().get("CPU", 0)
    actor = ray.remote(Host).options(num_cpus=1).remote(os.urandom(32))
    _, _, pid, node, started = ray.get(actor.address.remote(), timeout=60)
    running = actor.run.remote("engine9", print, ())  # waits for the driver's connections: working
    os.kill(pid, signal.SIGSTOP)
    try:
        ray.kill(actor, no_restart=True)
        ray.wait([running], timeout=30, fetch_local=False)  # Ray has called it dead...
        assert os.path.exists(f"/proc/{pid}")  # ...and the process is still there, stopped
        RayProcess(ray, actor, running, pid, node, started).kill()
        deadline = time.time() + 30
        while os.path.exists(f"/proc/{pid}") or ray.available_resources().get("CPU", 0) < cpus:
            assert time.time() < deadline, "the stopped actor's process or its CPU is still held"
            time.sleep(0.05)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
