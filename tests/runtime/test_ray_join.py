"""Engines joining a running Ray job as Ray actors (runtime/ray_join.py), on a real local Ray cluster:
`tailrace train --runtime.kind=ray` runs on the test's cluster (3 CPUs on loopback: the trainer's,
its engine's and a joiner's); `tailrace engine join RUN_DIR` starts an actor there that works as
engine 1, and leaves on SIGTERM to the command; a second joiner's command is killed (-9), so its actor
dies with it and the driver removes engine 2; a third works until the run ends and then exits 0,
while a fourth, finding no free CPU, says so at once and fails in one line when the run ends. The
test ends the run itself (SIGTERM, once all that happened: a run of fixed length raced the joiners'
starts); the ledger is exact at every step record, and no (group, sample) is trained twice."""

import json
import logging
import os
import signal

import pytest

from tests.runtime.conftest import TINY_RUN, start_cli
from tests.runtime.test_join_e2e import assert_exact, mark, read_until, wait_until, worked

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster_address():
    import ray

    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_ray_actors_join_and_leave_a_running_ray_job(cluster_address, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    train = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=2000",
        "--max_restarts=0", "--flow.mode=sync", "--runtime.kind=ray", f"--runtime.address={cluster_address}",
    )  # fmt: skip
    joined = []
    try:
        wait_until(lambda: (run_dir / "join.json").exists(), train, "join desk", timeout=180)
        where = json.loads((run_dir / "join.json").read_text())
        assert where["runtime"] == "ray" and where["ray_address"] == cluster_address
        assert where["host"] == "127.0.0.1"  # the cluster is on loopback, and so is the desk
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 1), train, "work on the joined actor, engine 1")
        os.kill(joined[0].pid, signal.SIGTERM)
        wait_until(lambda: mark(run_dir, "engine_leave"), train, "engine 1 leaving")
        assert joined[0].wait(timeout=60) == 0
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 2), train, "work on the joined actor, engine 2")
        os.killpg(joined[1].pid, signal.SIGKILL)  # its owner gone, Ray ends the actor: engine 2 died
        wait_until(lambda: len(mark(run_dir, "engine_leave")) == 2, train, "engine 2 removed")
        joined.append(start_cli("engine", "join", str(run_dir)))
        # engine 3's actor, placed (it joins from inside), holds the cluster's last CPU: a fourth joiner
        # started now finds no seat
        wait_until(lambda: len(mark(run_dir, "engine_join")) == 3, train, "engine 3 joining")
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 3), train, "work on the joined actor, engine 3")
        seatless = read_until(joined[3], "waiting up to 120 s for a seat: the cluster has 0 CPUs")
        os.kill(train.pid, signal.SIGTERM)
        out, _ = train.communicate(timeout=240)
        assert train.returncode == 143, out[-3000:]
        assert joined[2].wait(timeout=60) == 0, joined[2].stdout.read()[-3000:]  # let go as the run ended
        assert joined[3].wait(timeout=60) == 3  # it never joined: said at once, and why in one line
        seatless += joined[3].stdout.read()
        assert "Traceback" not in seatless and f"{run_dir}: the engine actor" in seatless
    finally:
        for p in [train, *joined]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert not (run_dir / "join.json").exists() and not (run_dir / "join.key").exists()
    joins = mark(run_dir, "engine_join")
    assert [m["engine"] for m in joins] == [1, 2, 3]
    assert all(m["actor"].startswith("engine-join-") and m["cores"] == [] for m in joins)
    leaves = {m["engine"]: m["why"] for m in mark(run_dir, "engine_leave")}
    assert leaves[1] == "asked to leave" and "died" in leaves[2] and set(leaves) == {1, 2}
    assert_exact(run_dir)


def test_a_policy_joins_a_running_ray_job_its_trainer_an_actor_of_its_own(
    cluster_address, tiny_model, tmp_path
):
    """`tailrace policy join` on a Ray job: the joiner's trainer is an actor in a placement group of its
    own (the cluster's third CPU), and both policies train their steps exactly."""
    from tests.runtime.conftest import run_cli
    from tests.runtime.test_policy_join_e2e import exact, records

    run_dir = tmp_path / "run"
    train = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=30",
        "--max_restarts=0", "--flow.mode=sync", "--runtime.kind=ray", f"--runtime.address={cluster_address}",
        "--policies=[{name: main}]", "--max_policies=2",
    )  # fmt: skip
    try:
        wait_until(lambda: (run_dir / "join.json").exists(), train, "join desk", timeout=180)
        joined = run_cli(
            "policy", "join", str(run_dir), "solver", "--task.seed=3", "--flow.steps=3", timeout=300
        )
        assert joined.returncode == 0, joined.stdout + joined.stderr
        out, _ = train.communicate(timeout=300)
        assert train.returncode == 0, out[-3000:]
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    exact(run_dir / "policies" / "main", 30)
    exact(run_dir / "policies" / "solver", 3)
    assert {r["tag"] for r in records(run_dir / "policies" / "solver", "eval")} == {"base", "final"}
    lanes = {
        e.get("lane") for e in (json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines())
    }
    assert "trainer-solver" in lanes
