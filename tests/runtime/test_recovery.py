"""Staying alive: a worker killed (SIGKILL) or stopped (SIGSTOP) mid-run is replaced and the run
finishes with exit 0, every step once, every finished trajectory once, the ledger exact, and a
`recovery` event. (`max_restarts=0` keeps the one-line fault: tests/runtime/test_faults.py.)"""

import os
import signal

import pytest

from tailrace.records import Finished, Mark, StepRecord, read_events, read_journal, read_metrics
from tests.runtime.conftest import TINY_RUN, start_cli, wait_for_steps, workers_of
from tests.runtime.test_faults import finish

pytestmark = pytest.mark.slow

STEPS = 8


def start(tiny_model, run_dir, *extra):
    return start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, f"--flow.steps={STEPS}",
        "--eval.n=8", *extra,
    )  # fmt: skip


def assert_exact(run_dir):
    """Every step once, every finished trajectory once, each trained group trained once and whole,
    and the ledger's identity: checked against the journal, not only the ledger's own counts."""
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]
    assert [r.step for r in steps] == list(range(STEPS))
    done = [(e.trajectory.group, e.trajectory.sample_index) for e in read_journal(run_dir / "journal.jsonl")
            if isinstance(e, Finished)]  # fmt: skip
    assert len(done) == len(set(done)), "a trajectory was finished twice"
    issued = [m.data["groups"] for m in read_events(run_dir / "events.jsonl")
              if isinstance(m, Mark) and m.kind == "train_issued"]  # fmt: skip
    trained = [g for groups in issued for g in groups]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    per_group = {g: sum(1 for d, _ in done if d == g) for g in trained}
    ledger = steps[-1].ledger
    assert ledger["trained"] == sum(per_group.values()) == sum(r.samples for r in steps)
    assert ledger["produced"] == len(done)
    assert ledger["produced"] == ledger["trained"] + ledger["in_store"] + sum(ledger["discarded"].values())


def recoveries(run_dir):
    return [m for m in read_events(run_dir / "events.jsonl") if isinstance(m, Mark) and m.kind == "recovery"]


@pytest.mark.parametrize(
    "who,sig",
    [("engine", signal.SIGKILL), ("engine", signal.SIGSTOP), ("trainer", signal.SIGKILL)],
    ids=["engine-killed", "engine-stopped", "trainer-killed"],
)
def test_a_lost_worker_is_replaced_and_the_run_finishes_exact(tiny_model, tmp_path, who, sig):
    run_dir = tmp_path / "run"
    p = start(tiny_model, run_dir, "--worker_timeout_s=3")
    wait_for_steps(run_dir, p, 2)
    trainer, engine = workers_of(p.pid)
    victim = engine if who == "engine" else trainer
    os.kill(victim, sig)
    try:
        rc, out = finish(p, timeout=120)
    finally:
        if sig == signal.SIGSTOP and os.path.exists(f"/proc/{victim}"):
            os.kill(victim, signal.SIGKILL)
    assert rc == 0, out
    assert "Traceback" not in out
    [rec] = recoveries(run_dir)
    name = "engine0" if who == "engine" else "trainer"
    assert rec.data["worker"] == name and rec.data["cause"] == ("stuck" if sig == signal.SIGSTOP else "died")
    assert f"recovered: {name}" in out
    assert_exact(run_dir)
